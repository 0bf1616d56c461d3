"""The lists that the rules on region code (region_policy.py) are made of: the modules a region
may import and what of each it may use, the builtins it may use, and the names, attributes and
statements it may not; and the builtins that make a function of the package one a region may not
import (region_policy_package.py: so does any module that is neither harmless nor the package)."""

from __future__ import annotations

import ast

# What a region may use of each module it may import, as `module.NAME` or `from module import NAME`
# (None: all of it; a name that is itself a module, torch.cuda, has its own entry). An allow list,
# because torch's surface is large and parts of it reach files or follow strings as attribute paths
# or imports (a red-team trial left through fuse_modules, set_default_tensor_type, PyTorchFileWriter
# and an Enum built by name): a region needs tensors, their dtypes and functions, and CUDA's events.
TORCH_NAMES = frozenset({
    # dtypes and the classes a region names
    "bool", "uint8", "int8", "int16", "int32", "int64", "long", "int", "float16", "half", "bfloat16", "float32",
    "float", "float64", "double", "Tensor", "Size", "device", "dtype", "Generator", "no_grad", "inference_mode",
    "cuda",
    # making tensors
    "tensor", "as_tensor", "zeros", "zeros_like", "ones", "ones_like", "empty", "empty_like", "full", "full_like",
    "arange", "linspace", "randint", "rand", "randn", "randperm", "multinomial",
    # computing with them
    "where", "cat", "concat", "stack", "hstack", "vstack", "split", "chunk", "narrow", "flatten", "reshape",
    "squeeze", "unsqueeze", "flip", "roll", "gather", "scatter", "index_select", "masked_select", "masked_fill",
    "take", "nonzero", "argwhere", "repeat_interleave", "searchsorted", "bucketize", "unique", "unique_consecutive",
    "sort", "argsort", "topk", "kthvalue", "cumsum", "cumprod", "diff", "sum", "prod", "mean", "max", "min",
    "maximum", "minimum", "amax", "amin", "argmax", "argmin", "clamp", "clip", "abs", "neg", "exp", "log", "sqrt",
    "floor", "ceil", "round", "remainder", "fmod", "softmax", "log_softmax", "any", "all", "count_nonzero",
    "numel", "is_tensor", "is_floating_point", "equal", "allclose", "isclose", "isin", "isnan", "isinf", "isfinite",
    "eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or", "logical_not", "logical_xor", "bitwise_and",
    "bitwise_or", "bitwise_not", "bitwise_xor", "add", "sub", "mul", "div", "matmul",
})
MODULE_NAMES: dict[str, frozenset[str] | None] = {
    "torch": TORCH_NAMES,
    "torch.cuda": frozenset({"Event", "Stream", "current_stream", "default_stream", "stream", "synchronize",
                             "is_available", "device_count", "current_device"}),
    # no deepcopy: its memo's keep-alive list hands out the live __dict__ of what it copied (a red-team
    # trial planted __array_interface__ there and numpy read any address), and it looks
    # __reduce_ex__ up on the instance, whose state it then sets with setattr
    "copy": frozenset({"copy"}),
    "time": frozenset({"perf_counter", "perf_counter_ns", "monotonic", "monotonic_ns", "time", "time_ns", "sleep"}),
    "functools": frozenset({"partial", "reduce", "lru_cache", "cache", "cached_property", "cmp_to_key"}),
    "collections": frozenset({"deque", "defaultdict", "Counter", "OrderedDict"}),
    "math": None, "itertools": None, "heapq": None, "bisect": None,
}
ALLOWED_IMPORTS = frozenset(module for module in MODULE_NAMES if "." not in module)
# The attributes a region may use: those the package's own code uses (its objects' fields and
# methods), a builtin container's or string's methods, and these tensor and stream methods; the
# deny list below still applies. An allow list: every red-team round found a library door by a
# name nothing in the engine needs (get_config_dict, symlink_to, untyped_storage, resize_, ...).
TENSOR_METHODS = frozenset({
    "to", "clone", "copy_", "fill_", "zero_", "index_copy_", "index_fill_", "index_put_", "index_add_",
    "index_select", "masked_fill", "masked_fill_", "masked_scatter_", "masked_select", "scatter", "scatter_",
    "scatter_add_", "gather", "view", "view_as", "reshape", "flatten", "unsqueeze", "squeeze", "expand",
    "expand_as", "repeat", "repeat_interleave", "contiguous", "tolist", "item", "numel", "nelement", "size",
    "dim", "shape", "dtype", "device", "is_cuda", "sum", "mean", "prod", "max", "min", "argmax", "argmin", "any",
    "all", "eq", "ne", "lt", "le", "gt", "ge", "long", "int", "float", "bool", "half", "cumsum", "cumprod",
    "clamp", "clamp_", "clamp_min", "clamp_max", "where", "nonzero", "sort", "argsort", "topk", "add", "add_",
    "sub", "sub_", "mul", "mul_", "div", "div_", "neg", "abs", "logical_and", "logical_or", "logical_not",
    "bitwise_and", "bitwise_or", "bitwise_not", "new_zeros", "new_ones", "new_full", "new_empty", "new_tensor",
    "narrow", "split", "chunk", "flip", "roll", "unique", "cpu", "cuda", "detach", "type_as", "equal",
    "allclose", "count_nonzero", "diff", "stride", "is_contiguous", "element_size", "record_stream", "T",
    "record", "query", "synchronize", "wait", "wait_event", "wait_stream", "elapsed_time",
})
BUILTIN_METHODS = frozenset(name for kind in (list, dict, set, frozenset, tuple, str, bytes, int, float, bool)
                            for name in dir(kind) if not name.startswith("_"))
NAMES_FROM = {"dataclasses": frozenset({"replace"})}  # modules a region may take only these names from
# modules a file of the package may take names from that a region may use bare (a dataclass's
# `replace`, typing's names); everything imported from any other module is out of reach
HARMLESS_SOURCES = ALLOWED_IMPORTS | {"__future__", "typing", "dataclasses", "enum", "numbers", "abc"}
# modules whose use inside a function of the package leaves it one a region may call: they compute
# (operator.index, re, random numbers) and reach no file, process or interpreter state
COMPUTING_SOURCES = HARMLESS_SOURCES | {"operator", "re", "random", "statistics", "struct", "textwrap", "string"}
SAFE_BUILTINS = frozenset({
    "abs", "all", "any", "ascii", "bin", "bool", "bytearray", "bytes", "callable", "chr", "complex", "dict",
    "divmod", "enumerate", "filter", "float", "frozenset", "hasattr", "hash", "hex", "id", "int", "isinstance",
    "issubclass", "iter", "len", "list", "map", "max", "min", "next", "oct", "ord", "pow", "print", "range", "repr",
    "reversed", "round", "set", "slice", "sorted", "str", "sum", "tuple", "zip", "NotImplemented", "Ellipsis",
})  # and the exception classes (capitalized builtins)
DENIED_NAMES = frozenset({
    # builtins that reach the interpreter, its objects by name, or the files
    "eval", "exec", "compile", "open", "getattr", "setattr", "delattr", "globals", "locals", "vars", "dir",
    "breakpoint", "input", "help", "memoryview", "type", "object", "super", "exit", "quit", "classmethod",
    "staticmethod", "property", "format", "aiter", "anext", "copyright", "credits", "license",
    # modules a file of the package may have imported
    "os", "sys", "subprocess", "gc", "inspect", "ctypes", "importlib", "builtins", "signal", "socket", "shutil",
    "pathlib", "Path", "io", "pickle", "marshal", "faulthandler", "multiprocessing", "tempfile", "threading",
    "pytest", "_pytest", "runpy", "atexit", "resource", "weakref", "traceback", "linecache", "site", "typing",
    "operator", "logging", "json", "contextlib", "dataclasses", "types", "copyreg", "platform", "glob", "codecs",
    "warnings", "asyncio", "concurrent", "selectors", "mmap", "fcntl", "pty", "shlex", "string", "sysconfig",
    "zipfile", "tarfile", "urllib", "http", "code", "codeop", "pdb", "cProfile", "profile", "tracemalloc",
    "_thread", "posix", "nt", "fileinput", "filecmp", "uuid", "webbrowser", "ssl", "select", "queue",
    # functools' helpers that copy attributes named by strings (update_wrapper(f, g, updated=("__globals__",))
    # fills the region's globals with another module's) or evaluate a function's annotations
    "update_wrapper", "wraps", "WRAPPER_ASSIGNMENTS", "WRAPPER_UPDATES", "singledispatch", "singledispatchmethod",
    # classes that build classes from a name and a namespace (dunders included): no class definition
    "Enum", "IntEnum", "StrEnum", "Flag", "IntFlag", "EnumMeta", "EnumType", "ABCMeta", "ABC", "NamedTuple",
    "namedtuple", "TypedDict", "NewType", "Protocol", "Generic", "dataclass", "make_dataclass",
})
DENIED_ATTRIBUTES = frozenset({
    # the interpreter, its frames and code
    "modules", "f_globals", "f_locals", "f_back", "f_code", "f_builtins", "f_trace", "tb_frame", "tb_next",
    "gi_frame", "gi_code", "gi_yieldfrom", "cr_frame", "cr_code", "cr_await", "ag_frame", "ag_code", "co_consts",
    "mro", "format_map", "vformat", "settrace", "setprofile", "attrgetter", "methodcaller", "get_type_hints",
    "environ", "putenv", "obj", "with_traceback",
    # processes
    "system", "popen", "fork", "forkpty", "kill", "killpg", "setsid", "spawnv", "execv", "execve", "Thread",
    "Process", "Popen", "start_new_thread",
    # files
    "load", "loads", "save", "dump", "dumps", "tofile", "fromfile", "from_file", "memmap", "savetxt",
    "savez", "loadtxt", "write_text", "write_bytes", "read_text", "read_bytes", "unlink", "rmdir", "rmtree",
    "rename", "chmod", "symlink", "mkdir", "makedirs", "touch", "export_chrome_trace", "export_stacks",
    "export_memory_timeline", "debug_dump", "read_file", "write_file", "set_filename", "tune_gemm_in_file",
    "download_url_to_file", "load_state_dict_from_url", "to_folder", "load_nvprof", "metal_capture",
    "load_compiled_function", "GdsFile",
    # torch's doors to compiled code, other processes, native libraries and files
    "ops", "library", "utils", "hub", "jit", "serialization", "distributed", "package", "testing", "fx",
    "overrides", "export", "classes", "profiler", "autograd", "onnx", "np", "numpy", "import_module",
    "compiler", "tunable", "gds", "cudart", "CUDAPluggableAllocator", "change_current_allocator", "load_library",
    "load_inline", "cpp_extension", "prepare_multiprocessing_environment", "monitor",
    # a second red-team trial's ways out through objects a region can reach from `self`: the model's
    # Hugging Face config (from_dict looks a dtype up by any string, from_json_file reads and
    # to_json_file writes any path), a Path's links and listings, nn.Module's lookups by dotted name
    # and hooks, rich's console saving to a file, a storage's class, a dataclass field's factory
    "from_dict", "from_json_file", "to_json_file", "to_json_string", "from_pretrained", "save_pretrained",
    "push_to_hub", "register_for_auto_class", "symlink_to", "hardlink_to", "iterdir", "readlink", "glob",
    "rglob", "get_submodule", "set_submodule", "get_parameter", "get_buffer", "get_extra_state",
    "register_module", "add_module", "register_buffer", "register_parameter", "load_state_dict", "state_dict",
    "register_forward_hook", "register_forward_pre_hook", "register_full_backward_hook",
    "register_full_backward_pre_hook", "register_backward_hook", "register_state_dict_pre_hook",
    "register_load_state_dict_post_hook", "save_text", "save_html", "save_svg", "storage_type", "default_factory",
    # a third round: the model (its Hugging Face config's get_config_dict reads any JSON file; its
    # nn.Module hooks and apply) is nothing a region needs, nor the tokenizer
    "model", "draft_model", "tokenizer", "get_config_dict", "register_load_state_dict_pre_hook",
    "register_state_dict_post_hook", "share_memory", "apply",
    # a fourth round: a Path's rename, links and ways to any other path
    "replace", "joinpath", "link_to", "cwd", "home", "lchmod", "owner", "group", "expanduser", "with_name",
    "with_stem", "with_suffix", "relative_to", "samefile",
    # a fifth round: a tensor's storage shrunk under it reads and writes the process's heap past its
    # buffer; an ABC's register changes what isinstance accepts everywhere
    "untyped_storage", "storage", "resize_", "resize_as_", "set_", "as_strided", "as_strided_", "data_ptr",
    "share_memory_", "apply_", "map_", "map2_", "register",
    # a sixth: Tensor.new(cdata=ADDRESS) takes any integer for a C++ tensor, and const_data_ptr gave
    # the addresses to aim it with (read and write anywhere: print's method entry became exec's)
    "new", "const_data_ptr", "mutable_data_ptr", "cdata",
    # a seventh: a partial's keywords, a live dict, bring back any keyword the call rules refuse
    "keywords",
})
# keyword arguments a region may not pass, and why (None: `**keywords`)
DENIED_KEYWORDS = {
    "file": "print's way to a file",
    "cdata": "torch.Tensor(cdata=ADDRESS) takes any integer for a C++ tensor: read and write anywhere",
    "out": "a result written into a tensor another object points into moves or frees its memory",
    "stream_id": "a CUDA stream made from any integer",
    None: "their names go unchecked, `**{'file': f}`",
}
# attributes the tests set on the engine: a region that assigns them changes what the tests see
TEST_SWITCHES = frozenset({"check_each_step"})
# builtins that make a function of the package one a region may not import
REACHING_BUILTINS = frozenset({"open", "eval", "exec", "compile", "__import__", "breakpoint", "input", "globals",
                               "locals", "vars"})
# denied builtins a region may use in one harmless form (_PlainGetattr, _compared_type)
NARROWED = {
    "getattr": 'only as getattr(obj, "name") or getattr(obj, "name", default), with the name written out',
    "type": "only to compare, as in type(x) is T or type(a) == type(b) (never called, stored or passed)",
}
# `match` too: a class pattern reads attributes named by plain strings (`case str(__class__=C)`)
DENIED_NODES = (ast.Global, ast.Nonlocal, ast.ClassDef, ast.AsyncFunctionDef, ast.Await, ast.AsyncFor,
                ast.AsyncWith, ast.Match)
