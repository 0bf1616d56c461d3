"""The grader's parts that need no check run: reading submissions from real laptops, what a region
may reach, how the judge turns a child's records into a verdict, and the scratch a killed run
leaves. (A whole class, hostile submissions included, is graded in test_grading_class.py.)"""

from __future__ import annotations

import codecs
import csv
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from minisgl.course import ROOT, grade, judge, judge_process, region_policy, submission
from minisgl.course import student_edition as edition
from minisgl.course.catalog import EXERCISES
from minisgl.course.judge_copy import put_regions
from minisgl.course.make_exercise import WRONG

IMPORT_LINE = "import copy\n"


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return edition.write_student_edition(tmp_path_factory.mktemp("grading") / "edition")


@pytest.fixture(scope="module")
def reference(base, tmp_path_factory) -> Path:
    return put_regions(base, grade.written_regions(ROOT), tmp_path_factory.mktemp("ref") / "reference")


def read(entry: Path, base: Path, tmp_path: Path) -> submission.Submission:
    sub = submission.Submission(submission.student_name(entry), [entry.name])
    scratch = tmp_path / f"scratch-{entry.name}"
    scratch.mkdir()
    tree, skipped = submission.tree_from_entry(entry, base, scratch)
    marked = {f"minisgl/{rel.as_posix()}": n for rel, n in grade.marked_files(base / "minisgl").items()}
    submission.read_tree(sub, base, tree, marked, skipped)
    sub.notes += skipped
    return sub


def test_text_from_any_laptop_reads_the_same():
    text = "def f():\n    return 1\n"
    for data in (text.replace("\n", "\r\n").encode(), codecs.BOM_UTF8 + text.encode(),
                 codecs.BOM_UTF16_LE + text.replace("\n", "\r\n").encode("utf-16-le"),
                 codecs.BOM_UTF16_BE + text.encode("utf-16-be"), text.replace("\n", "\r").encode()):
        assert submission.normalize_text(data) == text.encode(), data[:12]
    weights = bytes(range(256)) * 4
    assert submission.normalize_text(weights) == weights  # not text: left alone


def test_a_windows_or_mac_work_tree_and_a_powershell_patch_equal_the_reference(base, reference, tmp_path):
    crlf = tmp_path / "crlf"
    for path in reference.rglob("*"):
        target = crlf / path.relative_to(reference)
        if path.is_dir():
            target.mkdir(parents=True, exist_ok=True)
        elif path.suffix in (".py", ".md", ".toml", ".txt"):
            target.write_bytes(path.read_bytes().replace(b"\n", b"\r\n"))
        else:
            target.write_bytes(path.read_bytes())
    (crlf / ".DS_Store").write_bytes(b"\0\0\0\1Bud1")
    (crlf / "minisgl" / "Thumbs.db").write_bytes(b"\xd0\xcf")
    (crlf / "minisgl" / "__pycache__").mkdir()
    (crlf / "minisgl" / "__pycache__" / "batch.cpython-311.pyc").write_bytes(b"\x00" * 16)
    diff = subprocess.run(["git", "diff", "--no-index", "--", str(base / "minisgl"), str(reference / "minisgl")],
                          capture_output=True, text=True).stdout
    diff = diff.replace(f"a{base}/", "a/").replace(f"b{reference}/", "b/")
    patch = tmp_path / "powershell.patch"
    patch.write_bytes(codecs.BOM_UTF16_LE + diff.replace("\n", "\r\n").encode("utf-16-le"))
    expected = grade.written_regions(ROOT)
    for entry in (crlf, patch):
        sub = read(entry, base, tmp_path)
        assert sub.code == expected and sub.costs == {} and sub.notes == [], (entry.name, sub.costs, sub.notes)


def test_an_added_import_or_scratch_file_is_reported_and_an_edit_around_a_region_costs_only_its_exercise(
        reference, base, tmp_path):
    tree = put_regions(reference, {}, tmp_path / "tree")
    batch = tree / "minisgl" / "batch.py"
    batch.write_text(IMPORT_LINE + batch.read_text())
    (tree / "scratch.py").write_text("print('trying things')\n")
    release = tree / "minisgl" / "kv_ledger.py"
    release.write_text(release.read_text().replace("        req.released = True\n",
                                                   "        req.released = True\n        req.cached_len = 0\n", 1))
    sub = read(tree, base, tmp_path)
    assert sorted(sub.costs) == [4, 5], sub.costs  # the function around exercises 4's and 5's regions of _release
    assert all("in the function that holds the region" in c for cs in sub.costs.values() for c in cs)
    assert any("minisgl/batch.py line 1" in n for n in sub.notes) and any("scratch.py" in n for n in sub.notes)
    assert sub.code == grade.written_regions(ROOT)


@pytest.mark.parametrize("kind", ["symlink", "symlink-loop", "fifo", "broken-patch", "huge-patch", "not-a-patch",
                                  "file-is-a-folder", "link-to-root-in-patch", "binary-patch"])
def test_a_malformed_submission_is_not_gradable_with_one_reason(kind, base, reference, tmp_path):
    if kind == "symlink":
        entry = tmp_path / "alice"
        entry.symlink_to(reference)
    elif kind == "symlink-loop":
        entry = tmp_path / "alice.patch"
        entry.symlink_to(entry)
    elif kind == "fifo":
        entry = tmp_path / "alice.patch"
        os.mkfifo(entry)
    elif kind == "broken-patch":
        entry = tmp_path / "alice.patch"
        entry.write_text("--- a/minisgl/batch.py\n+++ b/minisgl/batch.py\n@@ -1,3 +1,3 @@\n-no such line\n+x\n")
    elif kind == "huge-patch":
        entry = tmp_path / "alice.patch"
        with open(entry, "wb") as f:
            f.truncate(submission.MAX_PATCH_BYTES + 1)
    elif kind == "not-a-patch":
        entry = tmp_path / "alice.zip"
        entry.write_bytes(b"PK")
    elif kind == "file-is-a-folder":
        entry = put_regions(reference, {}, tmp_path / "alice")
        (entry / "minisgl" / "batch.py").unlink()
        (entry / "minisgl" / "batch.py").mkdir()
    elif kind == "binary-patch":  # zlib-compressed: a few MiB of it once wrote gigabytes
        entry = tmp_path / "alice.patch"
        entry.write_text("diff --git a/x.bin b/x.bin\nnew file mode 100644\nindex 0000000..1111111\n"
                         "GIT binary patch\nliteral 3\nKcmZ>gU;qFB0RR91\n\nliteral 0\nHcmV?d00001\n\n")
    else:
        entry = tmp_path / "alice.patch"
        entry.write_text("diff --git a/minisgl/batch.py b/minisgl/batch.py\ndeleted file mode 100644\n"
                         "--- a/minisgl/batch.py\n+++ /dev/null\n@@ -1 +0,0 @@\n-x\n"
                         "diff --git a/minisgl/batch.py b/minisgl/batch.py\nnew file mode 120000\n"
                         "--- /dev/null\n+++ b/minisgl/batch.py\n@@ -0,0 +1 @@\n+/\n\\ No newline at end of file\n")
    with pytest.raises(submission.NotGradable) as caught:
        read(entry, base, tmp_path)
    assert "\n" not in str(caught.value) and len(str(caught.value)) < 300
    assert kind != "binary-patch" or "binary patch" in str(caught.value)  # refused before git apply runs it


def test_every_reference_and_known_wrong_region_may_run_and_code_that_reaches_outside_may_not():
    for number, bodies in grade.written_regions(ROOT).items():
        assert all(region_policy.region_problems(code) == [] for code in bodies.values()), number
        assert region_policy.refusal(bodies) == "", number  # in its own scope too
    for wrong in WRONG:
        assert all(region_policy.region_problems(textwrap.dedent(code)) == [] for code in wrong.regions.values()), \
            wrong.name
        assert region_policy.refusal({k: textwrap.dedent(c) for k, c in wrong.regions.items()}) == "", wrong.name
    for code in ("import sys\nsys.modules['_pytest.reports'].TestReport.outcome = 'passed'",
                 "open('/tmp/x', 'w').write('x')", "import os\nos.fork()", "x = self.__class__",
                 "t = torch.load('/etc/passwd')", "e = RuntimeError()\nf = e.__traceback__.tb_frame.f_globals",
                 "s = '{0.__globals__}'.format(self.commit)", "from .course import runner", "g = getattr(self, name)",
                 "g = getattr(self, '__class__')", "f = getattr", "m = getattr(torch, 'os')", "t = type(self)",
                 "c = type(ValueError)('C', (), {'__eq__': lambda s, o: True})", "import dataclasses",
                 "from dataclasses import make_dataclass", "import numpy",
                 "import subprocess", "x = self.engine._thread", *REACHES_OUTSIDE.values()):
        assert region_policy.region_problems(code), code
    for code in ("x: torch.Tensor = torch.zeros(1)", "def f(v: BatchView) -> torch.Tensor:\n    return v.mask",
                 "ok = isinstance(x, (torch.Tensor, BatchView))", "s = SpanName['SAMPLE']", "same = x is InFlight",
                 "try:\n    pass\nexcept (ValueError, KVAccountingError):\n    pass", "raise KVAccountingError('x')",
                 "import collections\nq = collections.deque()", "from collections import deque\nq = deque()",
                 "import torch\ntorch.cuda.synchronize()", "n = max(len(r.output_ids) for r in self.reqs)",
                 'mailbox = getattr(self, "tokens")', 'g = getattr(req.params, "grammar", None)',
                 "same = type(a) == type(b)", "from dataclasses import replace\nv = replace(view, reqs=[])"):
        assert region_policy.region_problems(code) == [], code  # what a student may well write


# What a hostile region tried (issue 36), or might: each reaches the interpreter, a file or a
# process through something a region may name, or changes what the tests call.
REACHES_OUTSIDE = {
    "a package module's gc": "from . import config as cfg\nobjs = cfg.gc.get_objects()",
    "a package module's Path": "from . import config as cfg\ncfg.Path('/tmp/escaped').touch()",
    "what a package module imported": "from .config import gc",
    "an import renamed": "from .scheduler import os as o\no.system('id')",
    "a package module": "from . import scheduler\nscheduler.time.sleep(0)",
    "torch's save imported": "from torch import save\nsave([1], '/tmp/x.pt')",
    "a torch module imported": "from torch import serialization as s",
    "torch's os": "torch.os.system('touch /tmp/x')",
    "torch's sys": "r = torch.sys.modules.get('_pytest.reports')",
    "torch's exit": "torch.os._exit(0)",
    "torch reads a file": "t = torch.from_file('/etc/passwd', size=4, dtype=torch.uint8)",
    "tunable writes a file": "torch.cuda.tunable.set_filename('/tmp/x')\ntorch.cuda.tunable.write_file()",
    "gds opens a file": "torch.cuda.gds.GdsFile('/tmp/x', 66)",
    "an allocator from a library": "torch.cuda.memory.CUDAPluggableAllocator('/lib/libc.so.6', 'system', 'free')",
    "a graph dumped": "torch.cuda.CUDAGraph().debug_dump('/tmp/x')",
    "numpy writes a file": "torch.zeros(1).numpy().tofile('/tmp/x')",
    "a library loaded": "torch.ops.load_library('/tmp/x.so')",
    "a module renamed": "t = torch\nt.equal = lambda *a: True",
    "a module passed": "import functools\nfunctools.update_wrapper(self, torch, assigned=('os',), updated=())",
    # a teacher's trial: a function's globals copied into the region's, then a private name of torch's
    "another module's globals copied": "import functools\ndef holder():\n    pass\n"
                                       "functools.update_wrapper(holder, torch.is_tensor, assigned=(), "
                                       "updated=('__globals__',))",
    "the same through wraps": "import functools\nw = functools.wraps(torch.is_tensor, (), ('__globals__',))",
    "a name planted in the globals": "run = _import_dotted_name('builtins.exec')",
    # a red-team trial: torch functions that follow strings as attribute paths or imports, or write files
    "a getattr by dotted strings": "got = []\ntorch.quantization.fuse_modules(torch.is_tensor, ['__globals__'], True, "
                                   "lambda mods, qat, extra: got.extend(mods))",
    "a setattr by dotted strings": "torch.quantization.fuse_modules(self, ['__class__.resolve'], True, "
                                   "lambda mods, qat, extra: [len])",
    "an import by name": "torch.set_default_tensor_type('ftplib.FTP')",
    "a file written": "w = torch.PyTorchFileWriter('/tmp/x')\nw.write_end_of_file()",
    "a class built by name": "E = torch.ao.quantization.quant_type.enum.Enum('E', {'A': 1, 'B': len})",
    "an enum of the file": "E = Enum('E', {'A': 1})",
    "a package parser that opens @files": "from .frontend.options import OneLineParser\n"
                                          "p = OneLineParser(fromfile_prefix_chars='@')",
    "copy's global table": "import copy\ncopy.dispatch_table[bytearray] = len",
    "a dunder in a string": "x = {'__builtins__': 1}",
    "annotations evaluated": "import functools\ndef h(x: \"__import__('os')\"):\n    pass\n"
                             "functools.singledispatch(h).register(h)",
    "a module in a list": "ms = [torch]",
    "a module as a default": "f = lambda m=torch: m",
    "a submodule handed around": "m = torch.cuda\nm.synchronize = None",
    "torch patched": "torch.equal = lambda *a: True",
    "a torch class patched": "torch.Tensor.tolist = lambda self: []",
    "time patched": "import time\ntime.monotonic = lambda: 0.0",
    "a package class patched": "BatchView.snapshot = lambda self: self",
    "a package class renamed": "c = BatchView\nc.snapshot = lambda self: self",
    "a package class attribute deleted": "del InFlight.view",
    "copy's types": "import copy\nf = copy.types.FunctionType",
    "copy's weakref": "import copy\nr = copy.weakref.ref",
    "a private module": "import collections\ns = collections._sys",
    "a generator's frame": "g = (i for i in [1])\nf = g.gi_frame.f_back.f_globals",
    "a frame's builtins": "g = (i for i in [1])\nb = g.gi_frame.f_builtins",
    "an error's object": "try:\n    torch.nope\nexcept AttributeError as e:\n    m = e.obj",
    "print to a file": "print('x', file=self)",
    "format on an object": "s = format(self, '')",
    "type": "t = type(self)",
    "classmethod": "c = classmethod(len)",
    "a global of the file": "os._exit(0)",
    "warnings of the file": "w = warnings.showwarning",
    "builtins by name": "b = __builtins__",
    "from builtins": "from builtins import open",
    "__future__": "from __future__ import annotations",
    "a thread": "torch.multiprocessing.Process(target=len)",
    "a package function that writes a file": "from .observe.trace import write_chrome_trace\n"
                                             "write_chrome_trace([], '/tmp/x')",
}


# A second red-team trial, each in the region it ran from: what `self` reaches (the model's
# Hugging Face config, the config's Path), package objects imported as constants, a submodule the
# import system bound in a package's globals.
REACHES_OUTSIDE_FROM = [
    ("the commit point", 'd = "_" * 2\nb = self.engine.model.config.from_dict({"dtype": d + "builtins" + d}).dtype'),
    ("publish", "from .observe.bench import console\nconsole.save_text('/tmp/x')"),
    ("resolve", "from .demo.paths import CHECKPOINT_DIR\nroot = CHECKPOINT_DIR.parents[2]"),
    ("staging write-after-read wait", "from .settings import SETTING\nP = SETTING['x'].kind"),
    ("allocate for the most a step can accept", "relay.SpecRelay.host_lengths = lambda self, rows: [0] * len(rows)"),
    ("skip_finished", "p = self.config.model_path"),
    ("checkpoint", "self.mechanisms.to_json_file('/tmp/x')"),
    ("deferred row free", "from dataclasses import fields\nc = [f.default_factory for f in fields(self)]"),
    ("snapshot", "print(1, **{'file': self})"),
    ("the decode row", "x = torch.zeros(1)"),  # mixed_chunk.py binds no torch: a NameError there
    # a third round: a class pattern's attributes are plain strings; the model's config reads JSON files
    ("length lookahead", "match SpanName.COMMIT:\n    case str(__class__=C):\n        C.x = 1"),
    ("the host waits for copy_done", "d = self.engine.model.config.get_config_dict('/tmp/x.json')"),
    # a fourth round: globals the region's file took from the package, used bare
    ("allocate for the most a step can accept", "p = DEMO_DRAFT_DIR"),
    ("the engine stream waits for the scheduler stream", "m = load_model('/tmp/m', torch.float32, torch.device('cpu'))"),
    # a fifth round: a storage shrunk under its tensor (memory past the buffer); the ABC registry
    ("publish", "import torch\na = torch.zeros(1 << 20, dtype=torch.uint8)\na.untyped_storage().resize_(1)"),
    ("delay the sampling", "Sequence.register(int)"),
    # a sixth round: a tensor made from a raw address (read and write anywhere), by a class's method
    # one level below an allowed module, by the legacy constructor's hidden keyword, or by keywords
    # that no rule sees
    ("publish", "import torch\nx = torch.Tensor.new(torch.zeros(1), cdata=5)"),
    ("publish", "import torch\np = torch.Tensor.const_data_ptr(torch.zeros(1))"),
    ("publish", "import torch\nx = torch.Tensor(cdata=id(self) + 16)"),
    ("publish", "import torch\nx = torch.Tensor(**{'cda' + 'ta': 5})"),
    ("publish", "p = print\np(1, **{'fi' + 'le': self})"),
    # a seventh: deepcopy's memo keeps the live __dict__ of what it copied (a dunder planted there
    # made numpy read any address); a partial's keywords, a live dict, bring any keyword back
    ("publish", "import copy\nmemo = {}\ncopy.deepcopy(self, memo)\nd = memo[id(memo)]"),
    ("publish", "import functools\np = functools.partial(print)\np.keywords.update([('fi' + 'le', self)])"),
    # an eighth: `self` bound by the region (any object's private attributes), an engine method or
    # the tests' audit switch replaced on a live object, a tensor's memory moved under a numpy view
    ("staging write-after-read wait", "def g(self):\n    return self._host_np\narr = g(buf)"),
    ("the engine stream waits for the scheduler stream", "(lambda self: self._queue)(self.stream).put(None)"),
    ("the commit point", "self.check_each_step = False"),
    ("the commit point", "self.kv_ledger.allocate = len"),
    ("staging write-after-read wait", "import torch\nx = torch.zeros(4, out=buf.blocks[0])"),
]


def test_a_region_is_held_to_the_scope_it_runs_in():
    for region, code in REACHES_OUTSIDE_FROM:
        assert region_policy.region_problems(code, region=region), (region, code)
    assert region_policy.region_problems("import torch\nx = torch.zeros(1)", region="the decode row") == []
    assert region_policy.region_problems("n = len(decodes)", region="the decode row") == []  # its function's
    # attributes: the engine's own, a builtin type's, the listed tensor methods; no library door by another name
    assert region_policy.region_problems("x = next_tokens.masked_fill(next_tokens < 0, 0).tolist()\nx.sort()",
                                         region="publish") == []
    assert region_policy.region_problems("d = self.tokens.register_hook(len)", region="publish")


def records(nonce_ok: bool = True, **outcomes: str) -> list[dict]:
    return [{"_nonce_ok": nonce_ok, "event": "outcome", "id": test, "outcome": outcome, "message": message,
             "when": "call", "exception": ""} for test, (outcome, message) in
            ((t, o.split("|", 1) if "|" in o else (o, "")) for t, o in outcomes.items())]


def test_the_judge_trusts_no_report_the_child_could_forge(tmp_path):
    j = judge.ReportReader(60, judge.TestTexts([ROOT / "lessons" / "exercises" / "tests"]))
    expected = {"tests/test_ex3_snapshot.py::test_the_request_list_is_copied": "passed", "t::b": "passed"}
    canary, secret = "tests/test_c.py::test_c", "s3cret"
    done = [{"_nonce_ok": True, "event": "done", "exit_code": "1"}]
    honest = records(**{t: "passed" for t in expected}, **{canary: f"failed|assert False, {secret}"}) + done
    verdict = j.verdict(3, honest, "exited", 1.0, canary, secret, expected)
    assert verdict.status == "passed" and verdict.mark == 1.0
    cases = {
        "canary passed": records(**{t: "passed" for t in expected}, **{canary: "passed"}) + done,
        "canary without its text": records(**{t: "passed" for t in expected}, **{canary: "failed|boom"}) + done,
        "no nonce": records(False, **{t: "passed" for t in expected}, **{canary: f"failed|{secret}"}) + done,
        "a test twice": honest[:1] + honest,
        "an unknown test": records(**{"t::LEAK from the teacher's guide": "passed"}) + honest,
    }
    for why, recs in cases.items():
        verdict = j.verdict(3, recs, "exited", 1.0, canary, secret, expected)
        assert verdict.status == "forged", why
        assert "LEAK" not in verdict.summary + "".join(t.rule for t in verdict.tests), verdict  # the judge's words only
    missing = j.verdict(3, honest[:1] + honest[2:], "exited", 1.0, canary, secret, expected)
    assert missing.status == "failed" and not missing.tests[1].passed
    assert j.verdict(3, honest[:1], "hang", 60.0, canary, secret, expected).status == "hang"
    assert j.verdict(3, honest[:1], "crash", 1.0, canary, secret, expected).status == "crash"


def test_a_students_message_holds_only_the_tests_own_text():
    texts = judge.TestTexts([ROOT / "lessons" / "exercises" / "tests"])
    test = "tests/test_ex3_snapshot.py::test_the_request_list_is_copied"
    leaked = "SECRET ANSWER return BatchView(self.batch_id, False, list(self.reqs)) " + (ROOT / "README.md").read_text()
    rule = texts.rule(test, leaked, "<script>")
    source = (ROOT / "lessons" / "exercises" / "tests" / "test_ex3_snapshot.py").read_text()
    assert "SECRET" not in rule and "BatchView(self" not in rule and "<script>" not in rule
    said = rule.split(": ", 1)[1]
    named = test.split("::")[1].removeprefix("test_").replace("_", " ")
    assert said == named or " ".join(said.split()) in " ".join(source.split()), rule


def test_an_interrupt_or_the_memory_limit_is_named_and_earns_nothing():
    j = judge.ReportReader(60, judge.TestTexts([ROOT / "lessons" / "exercises" / "tests"]), memory_gib=4.0)
    first, second = "tests/test_ex3_snapshot.py::test_the_request_list_is_copied", "t::b"
    expected = {first: "passed", second: "passed"}
    canary, secret = "tests/test_c.py::test_c", "s3cret"
    done = [{"_nonce_ok": True, "event": "done", "exit_code": "2"}]
    # a region raised KeyboardInterrupt in the first test: pytest stopped there and never ran the canary
    stopped = [{"_nonce_ok": True, "event": "start", "id": first},
               {"_nonce_ok": True, "event": "interrupted", "exception": "KeyboardInterrupt"}, *done]
    verdict = j.verdict(3, stopped, "exited", 1.0, canary, secret, expected)
    assert verdict.status == "interrupted" and verdict.mark == 0.0, verdict
    assert verdict.summary == "the check was interrupted (KeyboardInterrupt raised by the submission)"
    assert all(t.rule.endswith("did not run: " + verdict.summary) for t in verdict.tests), verdict.tests
    refused = ("RuntimeError: [enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
               "memory: you tried to allocate 9663676416 bytes. Error code 12 (Cannot allocate memory)")
    oom = records(**{first: f"failed|{refused}", second: "passed", canary: f"failed|assert False, {secret}"}) + done
    verdict = j.verdict(3, oom, "exited", 1.0, canary, secret, expected)
    assert verdict.status == "memory limit" and verdict.mark == 0.0, verdict
    assert verdict.summary == "memory limit: used more than 4 GiB" and verdict.tests[0].rule.endswith(verdict.summary)
    honest = records(**{first: "passed", second: "passed", canary: f"failed|assert False, {secret}"}) + done
    assert j.verdict(3, honest, "exited", 1.0, canary, secret, expected).status == "passed"
    # where the OS does not enforce the limit (macOS), the peak resident size tells
    assert j.verdict(3, honest, "exited", 1.0, canary, secret, expected, peak_rss=5 << 30).status == "memory limit"
    j.memory_gib = 0.0  # no limit: the same failure is the test's own
    assert j.verdict(3, oom, "exited", 1.0, canary, secret, expected).status == "failed"


def test_a_rule_is_the_whole_message_the_student_saw():
    """The rule of a failure is the message its test wrote, whole (the longest string of the test
    that the failure held used to be shown: an f-string's fragment, or a prompt); a value the run
    put into it shows only where it is a number or a string of the test file."""
    folders = [ROOT / "lessons" / "exercises" / "tests", ROOT / "tests"]
    texts = judge.TestTexts(folders)
    ex1 = "tests/test_ex1_overlap_loop.py::"
    seen = {  # the trial saw fragments of these, e.g. "schedule() in every call with a batch in flight; ..."
        ex1 + "test_an_early_commit_happens_where_must_commit_first_says":
            ("overlap_loop must ask _must_commit_first(last, planned) after schedule() in every call with a batch in "
             "flight; it never asked that while batch 5 was in flight assert []"),
        "tests/test_ex5_checkpoint.py::test_a_second_request_reuses_the_checkpoint_and_reads_the_right_kv":
            "the second request should reuse the first one's checkpointed prefix; reused 0\nassert 0 > 0",
        "tests/test_ex3_snapshot.py::test_the_snapshot_is_a_batch_view_not_the_live_batch_or_a_copy_of_it":
            ("snapshot() must build a BatchView of the values at launch; a copy of the RunningBatch (copy.copy) "
             "shares the live request list and its fields are computed when read, not at launch (got RunningBatch)"),
    }
    rules = [texts.rule(test, "AssertionError: " + message, "AssertionError") for test, message in seen.items()]
    assert rules == [
        "test_an_early_commit_happens_where_must_commit_first_says: overlap_loop must ask _must_commit_first(last, "
        "planned) after schedule() in every call with a batch in flight; it never asked that while batch 5 was in "
        "flight",
        "test_a_second_request_reuses_the_checkpoint_and_reads_the_right_kv: the second request should reuse the "
        "first one's checkpointed prefix; reused 0",
        "test_the_snapshot_is_a_batch_view_not_the_live_batch_or_a_copy_of_it: snapshot() must build a BatchView of "
        "the values at launch; a copy of the RunningBatch (copy.copy) shares the live request list and its fields "
        "are computed when read, not at launch (got …)",
    ], rules
    leak = " ".join((ROOT / "README.md").read_text().split()[:40])
    checked = 0
    for number, exercise in EXERCISES.items():
        for test in exercise.tests:
            if test.split("::")[0].startswith("tests/test_ex"):  # each message of the exercise's own tests
                file = Path(test).name
                for name, (templates, _) in texts._by_file[file][2].items():
                    for template in templates:
                        text = "".join(part for part in template if part is not None)
                        if len(" ".join(text.split())) < 12:
                            continue
                        said = " ".join("".join(part if part is not None else "7" for part in template).split())
                        message = f"AssertionError: {said}\nassert 7 == 8"
                        assert texts.rule(f"tests/{file}::{name}", message, "") == f"{name}: {said}", (file, name)
                        hostile = "".join(part if part is not None else leak for part in template)
                        assert leak not in texts.rule(f"tests/{file}::{name}", hostile, ""), (file, name)
                        checked += 1
    assert checked > 100, checked


def test_the_sheet_says_what_happened_beyond_each_mark(tmp_path):
    """grades.csv: a status in a word or two per student, and the whole rule behind it (a rule cut
    to 100 characters lost its point: "may import only bisect, ..., tim…"); grade-details.csv: a row
    per test."""
    def ex(number, status, *rules, tests=()):
        return grade.ExerciseGrade(number, float(status == "passed"), status, rules, tests)

    numpy = region_policy.refusal({"publish": "import numpy\nimport os\nx = open"})
    assert numpy.startswith("not run: a region may not import `numpy` (only ") and len(numpy) > 250, numpy
    notes = tuple(f"minisgl/batch.py line {n} changed outside the regions (not graded)" for n in range(5))
    grades = [
        grade.StudentGrade("ada", (ex(1, "passed"), ex(2, "failed", "test_x: a rule", tests=(("t::a", True, ""), (
            "t::x", False, "test_x: a rule"))), ex(3, "passed")), ()),
        grade.StudentGrade("bob", (ex(1, "refused", numpy), ex(2, "memory limit", "memory limit: used more than 8 GiB"),
                                   ex(3, "interrupted", "the check was interrupted (KeyboardInterrupt raised by the "
                                                        "submission)")), notes),
        grade.StudentGrade("cy", tuple(ex(n, "not gradable", "cy.patch does not apply") for n in (1, 2, 3)), ()),
    ]
    grade.write_sheet(grades, [1, 2, 3], tmp_path)
    with open(tmp_path / "grades.csv", newline="") as f:
        rows = {row["student"]: row for row in csv.DictReader(f)}
    assert [(r["ex1"], r["ex2"], r["ex3"], r["total"], r["status"]) for r in rows.values()] == [
        ("1", "0", "1", "2", "graded"), ("0", "0", "0", "0", "ex1: refused; ex2: memory limit; ex3: interrupted"),
        ("0", "0", "0", "0", "not gradable")]
    assert rows["ada"]["why"] == "" and rows["cy"]["why"] == "cy.patch does not apply"
    assert rows["bob"]["why"] == (f"ex1: {numpy} | ex2: memory limit: used more than 8 GiB | ex3: the check was "
                                  f"interrupted (KeyboardInterrupt raised by the submission)")
    assert rows["bob"]["notes"] == " | ".join(notes[:3]) + " (and 2 more)"
    with open(tmp_path / "grade-details.csv", newline="") as f:
        details = [(d["student"], d["exercise"], d["status"], d["test"], d["passed"], d["rule"]) for d in csv.DictReader(f)]
    assert details[:3] == [("ada", "2", "failed", "t::a", "True", ""), ("ada", "2", "failed", "t::x", "False",
                                                                         "test_x: a rule"),
                           ("bob", "1", "refused", "", "False", numpy)], details


def test_the_folders_the_grader_skips_are_named(tmp_path):
    for name in ("alice", "work", "build", "venv", ".git", "__MACOSX"):
        (tmp_path / name).mkdir()
    (tmp_path / ".DS_Store").write_bytes(b"\0")
    assert grade.skipped_folders(tmp_path) == [".git", "__MACOSX", "build", "venv", "work"]


def test_a_grader_killed_outright_leaves_nothing_for_the_next_run(base, reference, tmp_path):
    """SIGKILL cannot be caught: the next run removes what the killed one left (and its processes)."""
    subs = tmp_path / "subs"
    subs.mkdir()
    put_regions(base, {}, subs / "empty")
    temp = tmp_path / "temp"
    temp.mkdir()
    env = dict(os.environ, TMPDIR=str(temp), PYTHONPATH=str(ROOT))
    run = subprocess.Popen([sys.executable, "-m", "minisgl.course.grade", str(subs), "--out", str(tmp_path / "out"),
                            "--exercises", "3"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while not any(temp.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(2)  # into writing the edition or reading the class
    run.send_signal(signal.SIGKILL)
    run.wait()
    assert any(temp.iterdir()), "the killed run wrote no scratch: the test proves nothing"
    (tmp_path / "none").mkdir()
    again = subprocess.run([sys.executable, "-m", "minisgl.course.grade", str(tmp_path / "none"),
                            "--out", str(tmp_path / "out")], env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 2 and again.stderr.startswith("error: no submission"), again.stderr
    assert list(temp.iterdir()) == [] and not (tmp_path / "out").exists()


def test_identical_region_code_shares_one_check_and_a_code_change_does_not():
    """Comments, blank lines and spacing do not make code distinct, a changed statement does."""
    reference = grade.written_regions(ROOT)
    for number, bodies in reference.items():
        restyled = {name: "# my note\n\n" + body.replace(" = ", "  =  ", 1) for name, body in bodies.items()}
        changed = {name: "_unused = 0\n" + body for name, body in bodies.items()}
        assert grade.fingerprint(number, restyled) == grade.fingerprint(number, bodies), number
        assert grade.fingerprint(number, changed) != grade.fingerprint(number, bodies), number
    assert grade.fingerprint(1, reference[1]) != grade.fingerprint(2, reference[1])


def test_the_checkout_watch_sees_a_file_written_changed_or_removed_and_no_byte_code(tmp_path):
    root = tmp_path / "checkout"
    for rel in ("minisgl/batch.py", "lessons/TEACHER.md", ".git/hooks/pre-commit.sample", ".git/objects/ab/cd",
                "grades/grades.csv"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("x")
    watch = judge_process.CheckoutWatch(root, [root / "grades"])
    before = watch.listing()
    assert watch.changed(before, watch.listing()) == []
    (root / "minisgl" / "__pycache__").mkdir()
    (root / "minisgl" / "__pycache__" / "batch.cpython-311.pyc").write_bytes(b"\0")  # the grader's own imports
    (root / ".git" / "objects" / "ab" / "ef").write_text("y")  # git at work
    (root / "grades" / "grades.csv").write_text("written by the grader")
    assert watch.changed(before, watch.listing()) == []
    (root / "ESCAPED.txt").write_text("x")
    (root / ".git" / "hooks" / "pre-commit").write_text("#!/bin/sh\n")
    os.utime(root / "lessons" / "TEACHER.md", ns=(1, 1))
    (root / "minisgl" / "batch.py").unlink()
    assert watch.changed(before, watch.listing()) == sorted(
        str(root / rel) for rel in ("ESCAPED.txt", ".git/hooks/pre-commit", "lessons/TEACHER.md", "minisgl/batch.py"))


def test_a_check_is_confined_and_named_apart_from_the_teachers_checkout():
    """The zygote runs from the run's scratch (its argv names no file of the checkout); the
    interpreter is named through the venv's real folder; PATH drops the checkout's folders."""
    hidden = [str(ROOT)]
    path = os.pathsep.join([str(ROOT / ".venv" / "bin"), "/usr/bin"])
    old = os.environ.get("PATH")
    os.environ["PATH"] = path
    try:
        assert judge_process.path_without(hidden) == {"PATH": "/usr/bin"}
    finally:
        os.environ["PATH"] = old
    if Path(os.path.realpath(sys.prefix)) != ROOT / ".venv":
        assert not judge_process._interpreter().startswith(str(ROOT) + os.sep)


def test_what_python_or_a_diff_cannot_read_in_time_costs_a_row_not_the_run(base, reference, tmp_path):
    """A red-team trial stopped whole runs: a region nested past Python's recursion limit (ast.dump
    raised RecursionError), a file name that is not UTF-8 (the sheet could not be written), and a
    marked file padded with millions of lines (a quadratic diff, minutes a student)."""
    subs = tmp_path / "subs"
    deep = put_regions(reference, {2: {"resolve": "x = " + "+".join(["1"] * 1000) + "\nreturn input_ids\n"}},
                       subs / "deep")
    (deep / os.fsdecode(b"scratch_\xe9t\xe9.py")).write_text("x = 1\n")
    padded = put_regions(reference, {}, subs / "padded")
    (padded / "minisgl" / "batch.py").write_text((padded / "minisgl" / "batch.py").read_text() + "\n" * 100_000)
    put_regions(reference, {}, subs / "honest")
    out = tmp_path / "out"
    sheet = grade.main([str(subs), "--out", str(out), "--exercises", "3", "--jobs", "1"])
    rows = {row[0]: row for row in csv.reader(open(out / "grades.csv", encoding="utf-8"))}
    assert sheet == 0 and rows["honest"][1] == "1" and rows["padded"][1] == "0", rows
    assert "too much added to compare" in rows["padded"][-2] + rows["padded"][-1], rows["padded"]
    assert "scratch_\\udce9t\\udce9.py" in open(out / "grades.csv", encoding="utf-8").read()


def test_a_marked_file_missing_costs_only_its_exercises(base, reference, tmp_path):
    """A tree handed in from an older edition lacks the newer exercises' files: those exercises
    are lost, the others graded (issue 36's trial class was all "not gradable" for this)."""
    entry = put_regions(reference, {}, tmp_path / "older")
    marked = grade.marked_files(base / "minisgl")
    rel, numbers = next((rel, n) for rel, n in marked.items() if rel.as_posix() == "features/mixed_chunk.py")
    (entry / "minisgl" / rel).unlink()
    sub = read(entry, base, tmp_path)
    assert not sub.not_gradable and set(sub.costs) == set(numbers), (sub.costs, sub.not_gradable)
    assert all("missing" in why for n in numbers for why in sub.costs[n])


def test_a_symlinked_marked_file_or_a_tree_without_any_is_named_as_such(base, reference, tmp_path):
    """A trial class: a marked file that is a symlink read "is missing", and an empty folder
    "edited outside the markers"; the first costs its exercises, the second is not a work tree."""
    entry = put_regions(reference, {}, tmp_path / "linked")
    future_map = entry / "minisgl" / "future_map.py"
    future_map.unlink()
    future_map.symlink_to(ROOT / "minisgl" / "future_map.py")
    sub = read(entry, base, tmp_path)
    assert set(sub.costs) == {2} and "symlink" in sub.costs[2][0], sub.costs
    (tmp_path / "empty").mkdir()
    with pytest.raises(submission.NotGradable, match="not a work tree"):
        read(tmp_path / "empty", base, tmp_path)


def test_an_edit_around_a_region_that_ends_its_function_costs_its_exercise(base, reference, tmp_path):
    """A trial class: a region's closing marker is a comment after its function's last statement,
    so edits in a function that a region ends (10 of the regions) were charged to nothing."""
    for edit in ('"""Runs on the engine stream right after sampling batch n (mine)."""',
                 "# <<< exercise 2\n        self.tokens.zero_()"):
        entry = put_regions(reference, {}, tmp_path / f"edit-{len(edit)}")
        future_map = entry / "minisgl" / "future_map.py"
        old = ('"""Runs on the engine stream right after sampling batch n."""' if edit.startswith('"""')
               else "# <<< exercise 2")
        future_map.write_text(future_map.read_text().replace(old, edit, 1))
        sub = read(entry, base, tmp_path)
        assert set(sub.costs) == {2}, (edit, sub.costs, sub.notes)
    helper = put_regions(reference, {}, tmp_path / "helper")
    future_map = helper / "minisgl" / "future_map.py"
    future_map.write_text(future_map.read_text() + "\n\ndef my_helper():\n    return 1\n")
    assert read(helper, base, tmp_path).costs == {}  # a function of its own costs nothing


def test_a_region_indented_with_tabs_costs_what_the_students_own_checker_would(base, reference, tmp_path):
    """Python refuses a file whose indentation mixes tabs and spaces (TabError): the student's
    checker cannot import it, so the grade must not pass the region re-indented."""
    entry = put_regions(reference, {}, tmp_path / "tabs")
    future_map = entry / "minisgl" / "future_map.py"
    source = future_map.read_text()
    future_map.write_text(source.replace("        self.tokens[rows] = next_tokens", "\tself.tokens[rows] = next_tokens", 1))
    with pytest.raises(TabError):
        compile(future_map.read_text(), "future_map.py", "exec")
    sub = read(entry, base, tmp_path)
    assert set(sub.costs) == {2} and "TabError" in sub.costs[2][0], sub.costs


def test_a_zip_from_windows_reads_as_its_tree_and_one_that_points_outside_is_refused(base, reference, tmp_path):
    """Explorer's "Compressed folder": the tree in one folder, backslashes in the names, CRLF."""
    import zipfile

    entry = tmp_path / "dave.zip"
    with zipfile.ZipFile(entry, "w") as archive:
        for path in sorted(reference.rglob("*")):
            if path.is_file():
                name = "dave\\" + str(path.relative_to(reference)).replace("/", "\\")
                data = path.read_bytes()
                archive.writestr(name, data.replace(b"\n", b"\r\n") if path.suffix == ".py" else data)
    sub = read(entry, base, tmp_path)
    assert submission.student_name(entry) == "dave"
    assert sub.code == grade.written_regions(ROOT) and sub.costs == {} and sub.notes == [], (sub.costs, sub.notes)
    for i, name in enumerate(("../../evil.py", "/etc/evil.py", "C:\\evil.py", "minisgl\\..\\..\\evil.py")):
        hostile = tmp_path / f"mallory{i}.zip"
        with zipfile.ZipFile(hostile, "w") as archive:
            archive.writestr(name, "x = 1\n")
        with pytest.raises(submission.NotGradable, match="outside"):
            read(hostile, base, tmp_path)
    assert not (tmp_path / "evil.py").exists() and not (tmp_path.parent / "evil.py").exists()


def test_a_killed_grading_runs_scratch_is_removed_by_the_next_run(tmp_path):
    """A grader killed outright (SIGKILL) cannot clean up: the next run removes the scratch folders
    whose owner is gone, and leaves a live run's alone."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    killed, live = tmp_path / f"{grade.RUN_PREFIX}killed", tmp_path / f"{grade.RUN_PREFIX}live"
    for folder, owner in ((killed, dead.stdout.strip()), (live, str(os.getpid()))):
        (folder / "edition").mkdir(parents=True)
        (folder / "owner.pid").write_text(owner)
    assert grade.remove_stale_runs(tmp_path) == [killed]
    assert not killed.exists() and live.exists()
