"""`python -m minisgl ...` and the `minisgl` console script: the command line is frontend/cli.py."""

import signal
import sys
from collections.abc import Sequence

from .course import missing_exercise
from .frontend import cli


def main(argv: Sequence[str] | None = None) -> int:
    # Once the command is done and its exit code decided, Ctrl-C is ignored: it would land in the
    # interpreter's clean-up (torch's finalizers) and print a traceback under exit code 0.
    try:
        code = cli.main(argv)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    except KeyboardInterrupt:  # between the command's return and the line above
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        missing = missing_exercise(exc)  # an exercise's skeleton copy, before that exercise is written
        if missing is None:
            raise
        print(f"error: this needs exercise {missing['number']} ({missing['part']}), not written yet: "
              f"python -m minisgl course exercise {missing['number']} checks it", file=sys.stderr)
        return 2
    return code


if __name__ == "__main__":
    sys.exit(main())
