"""Extract, from the real sglang wheel, the API our SGLang adapter and its CPU stand-in rely on.

    python scripts/sglang_contract.py                 # download sglang==0.5.23 (--no-deps) and print the contract
    python scripts/sglang_contract.py --write         # ... and write tests/support/sglang_contract.json
    python scripts/sglang_contract.py --wheel PATH    # read a wheel already downloaded

Nothing is imported or run from the wheel: its sources are parsed with `ast`. The contract lists the Engine
methods with their parameters and whether they block on the Engine's own event loop (`run_until_complete`), the
TokenizerManager methods with their parameters, the request classes and their fields, the server-argument fields
the adapter passes, the memory tags, the flattened-bucket metadata fields, the error messages the stand-in
reproduces, the globals SGLang's `SafeUnpickler` lets a weight payload name, the model classes that can read a
weight back by name (`get_weights_by_name`), the fields of the tokenizer manager's per-request state, and what
building an Engine does to its host process (`host_process`: the event-loop policy its modules switch at import,
the multiprocessing start method it forces, the environment variables it sets, its `atexit` shutdown, how long its
shutdown waits for the processes it kills, whether a generate request holds the model-update lock across its
`yield`). `tests/unit/test_sglang_engine.py` compares the stand-in with the checked-in file.
"""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

SGLANG_VERSION = "0.5.23"
OUT = Path(__file__).resolve().parents[1] / "tests" / "support" / "sglang_contract.json"
ROOT = "sglang/srt/"

ENGINE_METHODS = (
    "__init__", "async_generate", "generate", "flush_cache", "init_weights_update_group",
    "destroy_weights_update_group", "begin_weight_update", "end_weight_update", "update_weights_from_distributed",
    "update_weights_from_tensor", "get_weights_by_name", "release_memory_occupation", "resume_memory_occupation",
    "shutdown",
)
TOKENIZER_MANAGER_METHODS = (
    "generate_request", "abort_request", "flush_cache", "init_weights_update_group", "destroy_weights_update_group",
    "begin_weight_update", "end_weight_update", "update_weights_from_distributed", "update_weights_from_tensor",
    "get_weights_by_name", "release_memory_occupation", "resume_memory_occupation", "pause_generation",
    "continue_generation",
)
REQUEST_CLASSES = (
    "FlushCacheReqInput", "FlushCacheReqOutput", "PauseGenerationReqInput", "ContinueGenerationReqInput", "InitWeightsUpdateGroupReqInput",
    "DestroyWeightsUpdateGroupReqInput", "BeginWeightUpdateReqInput", "EndWeightUpdateReqInput",
    "UpdateWeightsFromDistributedReqInput", "UpdateWeightsFromTensorReqInput", "GetWeightsByNameReqInput",
    "ReleaseMemoryOccupationReqInput", "ResumeMemoryOccupationReqInput",
)
GENERATE_FIELDS = (  # the GenerateReqInput fields the adapter sets
    "input_ids", "sampling_params", "return_logprob", "stream", "rid",
)
SERVER_ARGS = (
    "model_path", "tp_size", "mem_fraction_static", "max_running_requests", "random_seed", "dtype",
    "skip_tokenizer_init", "enable_memory_saver", "enable_weights_cpu_backup", "sampling_backend",
    "enable_deterministic_inference", "log_level", "base_gpu_id", "disable_cuda_graph", "nccl_port",
)
MESSAGES = {  # name -> (file, a substring that identifies the message)
    "tensor_update_outside_session": ("managers/scheduler_components/weight_updater.py",
                                      "update_weights_from_tensor must run between"),
    "distributed_update_outside_session": ("managers/scheduler_components/weight_updater.py",
                                           "update_weights_from_distributed must run between"),
    "session_already_open": ("managers/scheduler_components/weight_updater.py", "session is already open"),
    "no_session_open": ("managers/scheduler_components/weight_updater.py", "no weight-update session is open"),
    "release_not_idle": ("managers/scheduler_components/weight_updater.py",
                         "release_memory_occupation should be called only when server is idle"),
}


def download_wheel(dest: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "download", f"sglang=={SGLANG_VERSION}", "--no-deps", "-q", "-d",
                    str(dest)], check=True)
    return next(dest.glob("sglang-*.whl"))


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    """The parameters after `self` as in a signature: `name`, `name=default`, `*args`, `*`, `**kwargs`."""
    a = fn.args

    def one(arg: ast.arg, default: ast.expr | None) -> str:
        return arg.arg if default is None else f"{arg.arg}={ast.unparse(default)}"

    positional = [*a.posonlyargs, *a.args]
    defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    out = [one(arg, default) for arg, default in zip(positional, defaults, strict=True)]
    if a.vararg:
        out.append(f"*{a.vararg.arg}")
    elif a.kwonlyargs:
        out.append("*")
    out += [one(arg, default) for arg, default in zip(a.kwonlyargs, a.kw_defaults, strict=True)]
    if a.kwarg:
        out.append(f"**{a.kwarg.arg}")
    return out[1:] if out and out[0] == "self" else out


def _calls_run_until_complete(fn: ast.AST) -> bool:
    return any(isinstance(n, ast.Attribute) and n.attr == "run_until_complete" for n in ast.walk(fn))


def _methods(tree: ast.Module, class_names: tuple[str, ...]) -> dict[str, ast.FunctionDef | ast.AsyncFunctionDef]:
    out = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name in class_names:
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    out.setdefault(item.name, item)
    return out


def _class_fields(tree: ast.Module, name: str) -> list[list[Any]]:
    """[field, default source or None] of a (msgspec / dataclass) class body, in order."""
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return [[item.target.id, None if item.value is None else ast.unparse(item.value)]
                    for item in node.body if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)]
    raise KeyError(f"class {name} not found")


def extract(wheel: Path) -> dict[str, Any]:
    with zipfile.ZipFile(wheel) as zf:
        def parse(path: str) -> ast.Module:
            return ast.parse(zf.read(ROOT + path).decode())

        engine = _methods(parse("entrypoints/engine.py"), ("Engine",))
        tm = _methods(parse("managers/tokenizer_manager.py"), ("TokenizerManager",))
        tm.update({k: v for k, v in _methods(parse("managers/tokenizer_control_mixin.py"),
                                              ("TokenizerControlMixin",)).items() if k not in tm})
        io_struct = parse("managers/io_struct.py")
        server_fields: dict[str, str | None] = {}
        for name in zf.namelist():
            if name.startswith(ROOT + "arg_groups/fields/") and name.endswith(".py"):
                for node in ast.walk(ast.parse(zf.read(name).decode())):
                    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                        server_fields.setdefault(node.target.id, None if node.value is None else ast.unparse(node.value))
        tags = _memory_tags(parse("constants.py"))
        messages = {}
        for key, (path, needle) in MESSAGES.items():
            found = [n.value for n in ast.walk(parse(path)) if isinstance(n, ast.Constant) and isinstance(n.value, str)
                     and needle in n.value]
            if not found:
                raise KeyError(f"message {needle!r} not found in {path}")
            messages[key] = found[0]
        missing = [m for m in ENGINE_METHODS if m not in engine] + [m for m in TOKENIZER_MANAGER_METHODS if m not in tm]
        if missing:
            raise KeyError(f"methods not found: {missing}")
        generate_fields = dict(_class_fields(io_struct, "GenerateReqInput"))
        tm_tree = parse("managers/tokenizer_manager.py")
        return {
            "sglang_version": SGLANG_VERSION,
            "engine_methods": {m: {"params": _params(engine[m]), "async": isinstance(engine[m], ast.AsyncFunctionDef),
                                   "blocks_on_engine_loop": _calls_run_until_complete(engine[m])}
                               for m in ENGINE_METHODS},
            "engine_assigns_self_tokenizer": _assigns_self_attribute(parse("entrypoints/engine.py"), "Engine",
                                                                     "tokenizer"),
            "tokenizer_manager_methods": {m: {"params": _params(tm[m]), "async": isinstance(tm[m], ast.AsyncFunctionDef)}
                                          for m in TOKENIZER_MANAGER_METHODS},
            "request_classes": {c: _class_fields(io_struct, c) for c in REQUEST_CLASSES},
            "generate_request_fields": {f: generate_fields[f] for f in GENERATE_FIELDS},
            "server_args": {f: server_fields[f] for f in SERVER_ARGS},
            "memory_tags": tags,
            "flattened_tensor_metadata_fields": [f for f, _ in _class_fields(parse("weight_sync/tensor_bucket.py"),
                                                                              "FlattenedTensorMetadata")],
            "messages": messages,
            "safe_unpickler_allowed": sorted(_safe_unpickler_allowed(parse("utils/common.py"))),
            "req_state_fields": [f for f, _ in _class_fields(tm_tree, "ReqState")],
            "host_process": host_process(parse("entrypoints/engine.py"), tm_tree, tm["generate_request"]),
            "models_with_get_weights_by_name": sorted(
                cls.name for name in zf.namelist() if name.startswith(ROOT + "models/") and name.endswith(".py")
                for cls in ast.parse(zf.read(name).decode()).body if isinstance(cls, ast.ClassDef)
                and any(isinstance(f, ast.FunctionDef) and f.name == "get_weights_by_name" for f in cls.body)
            ),
        }


def _module_level_policy_switch(tree: ast.Module) -> bool:
    """Whether a module switches the global asyncio event-loop policy when imported."""
    return any(isinstance(n, ast.Expr) and isinstance(n.value, ast.Call) and isinstance(n.value.func, ast.Attribute)
               and n.value.func.attr == "set_event_loop_policy" for n in tree.body)


def _function(tree: ast.Module, name: str) -> ast.FunctionDef:
    return next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)


def _environment_set(fn: ast.AST) -> dict[str, str | None]:
    """`os.environ[KEY] = value` in `fn`: KEY -> the value when it is a literal string, else None."""
    out: dict[str, str | None] = {}
    for node in ast.walk(fn):
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Subscript):
            target = node.targets[0]
            if ast.unparse(target.value) == "os.environ" and isinstance(target.slice, ast.Constant):
                value = node.value.value if isinstance(node.value, ast.Constant) else None
                out[target.slice.value] = value
    return dict(sorted(out.items()))


def _keyword_of_call(fn: ast.AST, callee: str, keyword: str) -> Any:
    """The literal value of `keyword` in the first call of `callee` inside `fn`."""
    for node in ast.walk(fn):
        if isinstance(node, ast.Call) and ast.unparse(node.func).endswith(callee):
            for kw in node.keywords:
                if kw.arg == keyword:
                    return ast.literal_eval(kw.value)
    raise KeyError(f"no {callee}({keyword}=...) call found")


def _holds_lock_across_yield(fn: ast.AST, lock: str) -> bool:
    """Whether an `async with <...lock...>` block of `fn` yields inside it (the lock is held while the caller has
    the generator's value, until the generator is resumed or closed)."""
    return any(isinstance(n, ast.AsyncWith) and any(lock in ast.unparse(i.context_expr) for i in n.items)
               and any(isinstance(y, (ast.Yield, ast.YieldFrom)) for y in ast.walk(n)) for n in ast.walk(fn))


def host_process(engine: ast.Module, tokenizer_manager: ast.Module, generate_request: ast.AST) -> dict[str, Any]:
    """What building an Engine does to the process that builds it (see the module docstring)."""
    engine_cls = next(n for n in engine.body if isinstance(n, ast.ClassDef) and n.name == "Engine")
    init = next(n for n in engine_cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    shutdown = next(n for n in engine_cls.body if isinstance(n, ast.FunctionDef) and n.name == "shutdown")
    configure = _function(engine, "_set_envs_and_config")
    start_method = next(ast.literal_eval(n.args[0]) for n in ast.walk(configure) if isinstance(n, ast.Call)
                        and ast.unparse(n.func).endswith("set_start_method"))
    return {
        "policy_switched_on_import": {"entrypoints/engine.py": _module_level_policy_switch(engine),
                                      "managers/tokenizer_manager.py": _module_level_policy_switch(tokenizer_manager)},
        "start_method_forced": start_method,
        "environment_set": _environment_set(configure),
        "atexit_shutdown": any(ast.unparse(n) == "atexit.register(self.shutdown)" for n in ast.walk(init)),
        "shutdown_kills_descendants_of_own_pid": any(isinstance(n, ast.Call) and ast.unparse(n.func) ==
                                                      "kill_process_tree" and ast.unparse(n.args[0]) == "os.getpid()"
                                                      for n in ast.walk(shutdown)),
        "shutdown_kill_wait_s": _keyword_of_call(shutdown, "kill_process_tree", "wait_timeout"),
        "generate_holds_update_lock_across_yield": _holds_lock_across_yield(generate_request, "model_update_lock"),
    }


def _safe_unpickler_allowed(common: ast.Module) -> list[str]:
    """`module.name` of every global SGLang's `SafeUnpickler` lets a weight payload name."""
    cls = next(n for n in common.body if isinstance(n, ast.ClassDef) and n.name == "SafeUnpickler")
    allowed = next(n.value for n in cls.body if isinstance(n, ast.Assign) and n.targets[0].id == "ALLOWED_GLOBALS")
    return [".".join(ast.literal_eval(e)) for e in allowed.elts]


def _assigns_self_attribute(tree: ast.Module, class_name: str, attribute: str) -> bool:
    """Whether any method of the class assigns `self.<attribute>`."""
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name)
    return any(isinstance(t, ast.Attribute) and t.attr == attribute and isinstance(t.value, ast.Name)
               and t.value.id == "self" for n in ast.walk(cls) if isinstance(n, (ast.Assign, ast.AnnAssign))
               for t in (n.targets if isinstance(n, ast.Assign) else [n.target]))


def _memory_tags(constants: ast.Module) -> list[str]:
    values = {n.targets[0].id: n.value for n in constants.body
              if isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Name)}
    return [ast.literal_eval(values[e.id]) for e in values["GPU_MEMORY_ALL_TYPES"].elts]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--wheel", help="an sglang wheel already downloaded")
    parser.add_argument("--write", action="store_true", help=f"write {OUT.relative_to(OUT.parents[2])}")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        wheel = Path(args.wheel) if args.wheel else download_wheel(Path(tmp))
        contract = extract(wheel)
    text = json.dumps(contract, indent=1, sort_keys=True) + "\n"
    if args.write:
        OUT.write_text(text)
        print(f"wrote {OUT}")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
