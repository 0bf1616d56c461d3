"""The lists that the rules on region code (region_policy.py) are made of: the modules a region
may import, the builtins it may use, and the names, attributes and statements it may not; and the
modules and builtins that make a function of the package one a region may not import."""

from __future__ import annotations

import ast

ALLOWED_IMPORTS = frozenset({"torch", "copy", "math", "time", "itertools", "functools", "collections",
                             "heapq", "bisect"})
NAMES_FROM = {"dataclasses": frozenset({"replace", "fields"})}  # modules a region may take only these names from
# modules a file of the package may take names from that a region may use bare (a dataclass's
# `replace`, typing's names); everything imported from any other module is out of reach
HARMLESS_SOURCES = ALLOWED_IMPORTS | {"__future__", "typing", "dataclasses", "enum", "numbers", "abc"}
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
})
# modules whose names make a function of the package one a region may not import
REACHING_MODULES = frozenset({
    "os", "sys", "subprocess", "pathlib", "io", "pickle", "marshal", "shutil", "tempfile", "socket", "ctypes",
    "importlib", "builtins", "multiprocessing", "threading", "_thread", "signal", "gc", "inspect", "runpy",
    "faulthandler", "resource", "mmap", "fcntl", "pty", "asyncio", "urllib", "http", "zipfile", "tarfile", "glob",
    "codecs", "webbrowser", "ssl", "select", "selectors", "pdb", "code", "platform", "logging", "csv", "sqlite3",
    "safetensors", "uvicorn", "zmq", "starlette", "concurrent", "tracemalloc", "cProfile", "profile",
})
# builtins that make a function of the package one a region may not import
REACHING_BUILTINS = frozenset({"open", "eval", "exec", "compile", "__import__", "breakpoint", "input", "globals",
                               "locals", "vars"})
# denied builtins a region may use in one harmless form (_PlainGetattr, _compared_type)
NARROWED = {
    "getattr": 'only as getattr(obj, "name") or getattr(obj, "name", default), with the name written out',
    "type": "only to compare, as in type(x) is T or type(a) == type(b) (never called, stored or passed)",
}
DENIED_NODES = (ast.Global, ast.Nonlocal, ast.ClassDef, ast.AsyncFunctionDef, ast.Await, ast.AsyncFor,
                ast.AsyncWith)
