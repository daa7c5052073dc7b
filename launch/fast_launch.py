"""Relaunch a compiled Triton kernel without `JITFunction.run`'s per-call work.

Why: a PIECEWISE step launches the attention kernel eagerly once per layer (the graph segments
around it replay), so the Python cost of a launch is paid ~30 times per step of a 30-layer model.
`kernel[grid](...)` binds and specialises every argument, builds a cache key from the
specialisation and the options, looks the compiled kernel up, checks the kernel's globals and
builds launch metadata before it reaches the C launcher. For a kernel of ~35 arguments that is
tens of microseconds, more than the GPU spends on a decode layer of a small model.

`FastLaunch(fn)(grid, *args, num_warps=.., num_stages=..)` takes ALL of the kernel's parameters
positionally (constexprs included, in signature order), computes a small key that covers
everything Triton specialises on (constexpr values; dtype and 16-byte alignment of each tensor;
for integers not in `do_not_specialize`, whether the value is 1 or a multiple of 16; whether an
integer fits in 32 bits), and:
- on a new key, launches through `fn[grid](...)` as usual (compiling if needed) and keeps the
  `CompiledKernel` that call returns;
- on a known key, calls that kernel's C launcher directly, with the same arguments Triton
  itself passes it (`JITFunction.run`: grid, stream, function, packed metadata, launch metadata,
  enter/exit hooks, then every bound argument in order).
`num_sms(device)` is the SM count the kernels size their grids by (one cached helper for all).
Launch hooks (profilers such as proton) and Triton's interpreter (CPU tests) take the ordinary
path every time; KernelConfig.fast_launch=False (configs/kernel_config.py) turns the fast path off. A GPU
test checks that both paths give identical results.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from configs.kernel_config import active_kernel_config
from launch import compile_ahead as _ahead
from launch.specialisation import CONSTEXPR, I32_MAX, I32_MIN, SPECIALISED, param_kinds, specialisation

def _key_function(args: tuple, kinds: tuple[int, ...]) -> Callable:
    """Generated `(options, *args) -> key` equal to `FastLaunch.key` for arguments of these types."""
    parts = []
    for i, (arg, kind) in enumerate(zip(args, kinds)):
        if kind == CONSTEXPR:
            parts.append(f"a{i}")
        elif type(arg) is int:
            fits = f"{I32_MIN} <= a{i} <= {I32_MAX}"
            parts.append(f"(a{i} == 1, a{i} % 16 == 0, {fits})" if kind == SPECIALISED else f"({fits})")
        elif type(arg) is float or type(arg) is bool or arg is None:
            parts.append("None")
        else:
            parts.append(f"(a{i}.dtype, a{i}.data_ptr() % 16 == 0)")
    names = ", ".join(f"a{i}" for i in range(len(args)))
    source = f"def key(options, {names}):\n    return (*options, {', '.join(parts)})\n"
    namespace: dict = {}
    exec(source, namespace)
    return namespace["key"]


def _hook_active(hook: Any) -> bool:
    """Triton's launch hooks are None or, in later versions, a HookChain that is empty unless a
    profiler added calls to it."""
    return hook is not None and (not hasattr(hook, "calls") or bool(hook.calls))


try:
    from triton import knobs as _knobs
except ImportError:  # a Triton before knobs: no fast path
    _knobs = None
try:
    from triton.runtime._async_compile import FutureKernel as _FutureKernel
except ImportError:  # a Triton without async compilation (compile_ahead is off)
    _FutureKernel = ()


def _launch_hooks_set() -> bool:
    if _knobs is None:
        return True
    runtime = _knobs.runtime
    return _hook_active(runtime.launch_enter_hook) or _hook_active(runtime.launch_exit_hook)


def _current_stream(device_index: int) -> int:
    import torch
    return torch._C._cuda_getCurrentRawStream(device_index)


def _current_device() -> int:
    """The current CUDA device's index, where Triton's own launch takes its stream from."""
    import torch
    return torch._C._cuda_getDevice()


def _triton_options(num_warps: int, num_stages: int, launch_pdl: bool) -> dict:
    """Launch options for `fn[grid](...)`; `launch_pdl` only when set (the interpreter lacks it)."""
    return dict(num_warps=num_warps, num_stages=num_stages, **({"launch_pdl": True} if launch_pdl else {}))


class FastLaunch:
    """A launcher for one @triton.jit function; see the module docstring."""

    def __init__(self, fn: Any, stream_of: Callable[[int], int] = _current_stream) -> None:
        self.fn = fn
        self.kinds = param_kinds(fn)
        self.stream_of = stream_of
        self.compiled: dict[tuple, Any] = {}
        self._launch_tails: dict[int, tuple[Any, tuple | None]] = {}
        """Per compiled kernel (by id): the kernel, and what Triton's launcher passes its C launch
        between (grid, stream) and the kernel's arguments, or None where `direct_launch` cannot
        be used (see there)."""
        self.fast_launches = 0
        self._key_fn: Callable | None = None
        self._key_types: tuple = ()
        """Launches that skipped JITFunction.run (for tests and benchmarks)."""

    @property
    def enabled(self) -> bool:
        return self.kinds is not None and active_kernel_config().fast_launch

    def key(self, args: tuple, options: tuple) -> tuple:
        """Everything Triton specialises a compiled kernel on, for these arguments."""
        return (*options, *specialisation(args, self.kinds))

    def _ordinary_path(self, args: tuple) -> bool:
        """Whether a call with `args` takes Triton's own launch: inside compile_ahead (only queuing
        compiles), an unsupported signature, the fast path switched off, a wrong argument count, or
        launch hooks (profilers) set."""
        return (_ahead._active or self.kinds is None or not active_kernel_config().fast_launch
                or len(args) != len(self.kinds) or _launch_hooks_set())

    def _fast_key(self, args: tuple, options: tuple) -> tuple:
        """`key`, from a function generated for the argument types of the first call (one
        expression per argument instead of a loop with type tests: a few microseconds less per
        launch). Arguments of other types than that first call's get the generic `key`, marked
        so the two kinds of key never compare equal."""
        types = tuple(map(type, args))
        if self._key_fn is None or types != self._key_types:
            if self._key_fn is not None:
                return ("generic",) + self.key(args, options)
            self._key_types, self._key_fn = types, _key_function(args, self.kinds)
        return self._key_fn(options, *args)

    def __call__(self, grid: tuple[int, ...], *args: Any, device_index: int = 0,
                 num_warps: int = 4, num_stages: int = 3, launch_pdl: bool = False) -> Any:
        """`launch_pdl`: launch with programmatic dependent launch (launch/pdl.py); a
        compile option, so part of the key (only passed on when set: the interpreter has no such option).
        Returns the CompiledKernel that ran when the fast path applies (for `relaunch`), else None
        (also inside `compile_ahead`, where nothing runs: the compile is only queued)."""
        if self._ordinary_path(args):
            _ahead.launch(self.fn, grid, *args, **_triton_options(num_warps, num_stages, launch_pdl))
            return None
        key = self._fast_key(args, (device_index, num_warps, num_stages, launch_pdl))
        kernel = self.compiled.get(key)
        if kernel is None:
            kernel = self.fn[grid](*args, **_triton_options(num_warps, num_stages, launch_pdl))
            if isinstance(kernel, _FutureKernel):   # launched inside compile_ahead: compiled by now
                kernel = kernel.result()
            if kernel is None or not hasattr(kernel, "function"):
                return None
            self.compiled[key] = kernel
            return kernel
        self.relaunch(kernel, grid, args, device_index)
        return kernel

    def compiled_kernel(self, args: tuple, device_index: int = 0, num_warps: int = 4, num_stages: int = 3,
                        launch_pdl: bool = False) -> Any:
        """The CompiledKernel a call with these arguments and options would launch, without launching
        it; None where the call would not take the fast path or has not compiled it yet."""
        if self._ordinary_path(args):
            return None
        return self.compiled.get(self._fast_key(args, (device_index, num_warps, num_stages, launch_pdl)))

    def relaunch(self, kernel: Any, grid: tuple[int, ...], args: tuple, device_index: int = 0,
                 stream: int | None = None) -> None:
        """Launch `kernel` (returned by a call) again with arguments of the same key, without
        computing the key: the caller vouches for every dtype, alignment, specialised integer and
        constexpr (unified_attention.StepAttention checks what can change between its calls).
        `stream`: the raw stream, when the caller knows it is the current one."""
        grid_1 = grid[1] if len(grid) > 1 else 1
        grid_2 = grid[2] if len(grid) > 2 else 1
        kernel.run(grid[0], grid_1, grid_2, stream if stream is not None else self.stream_of(device_index),
                   kernel.function, kernel.packed_metadata, None, None, None, *args)
        self.fast_launches += 1


    def direct_launch(self, kernel: Any, grid: tuple[int, ...], stream: int) -> Callable[..., None] | None:
        """A callable `(*args)` that launches `kernel` on `grid` and `stream` straight through
        Triton's C launch function, or None where that is not known to be safe (then use
        `relaunch`). Why: Triton's Python launcher (`kernel.run`) builds two closures and asks
        two allocators for scratch on every call before it reaches the C launch (host time per
        call: `graphrunner bench launch`); a PIECEWISE step pays it once per layer. Safe because it is learned, not assumed: once per
        kernel, `kernel.run` is called with marker values while its C launch is swapped for a
        recorder (nothing launches); the call must reach it as (grid, stream, <tail>, *args) with
        no scratch buffer in the tail (a kernel that needs per-launch scratch gets None). The
        caller vouches for the arguments as for `relaunch` (all of them, constexprs included;
        tensors may be passed as their device addresses)."""
        learned = self._launch_tails.get(id(kernel))
        if learned is None:   # keyed by id, holding the kernel (so the id is never reused)
            learned = self._launch_tails[id(kernel)] = (kernel, _learn_launch_tail(kernel, len(self.kinds or ())))
        tail = learned[1]
        if tail is None:
            return None
        grid_1 = grid[1] if len(grid) > 1 else 1
        grid_2 = grid[2] if len(grid) > 2 else 1
        return functools.partial(kernel.run.launch, grid[0], grid_1, grid_2, stream, *tail)


class _Marker:
    """An argument no launcher would make up (see `_learn_launch_tail`)."""


def _learn_launch_tail(kernel: Any, num_args: int) -> tuple | None:
    runner = getattr(kernel, "run", None)
    launch = getattr(runner, "launch", None)
    if launch is None or num_args == 0:
        return None
    grid_stream, args, seen = (7, 11, 13, 17), tuple(_Marker() for _ in range(num_args)), []
    own = "launch" in vars(runner)
    runner.launch = lambda *a: seen.append(a)
    try:
        runner(*grid_stream, kernel.function, kernel.packed_metadata, None, None, None, *args)
    except Exception:   # a launcher that does something else with its arguments: not this path
        return None
    finally:
        if own:
            runner.launch = launch
        else:
            del runner.launch
    if len(seen) != 1 or len(seen[0]) < 4 + num_args:
        return None
    called = seen[0]
    tail = called[4:len(called) - num_args]
    if called[:4] != grid_stream or any(a is not b for a, b in zip(called[len(called) - num_args:], args)):
        return None
    if any(hasattr(value, "data_ptr") or isinstance(value, _Marker) for value in tail):
        return None   # scratch allocated for this launch: it must be allocated per launch
    return tail


_LAUNCH_OPTIONS = frozenset(("num_warps", "num_stages", "launch_pdl"))


class _KeywordLauncher:
    """One kernel's shared FastLaunch, and how each of its call sites' keyword sets maps onto its
    parameters (`_keyword_plan`, by (positional count, keywords))."""

    def __init__(self, fn: Any, launcher: FastLaunch | None = None) -> None:
        self.fn, self.launcher = fn, launcher or FastLaunch(fn)
        self.plans: dict[tuple, tuple | None] = {}


_launchers: dict[int, _KeywordLauncher] = {}
"""By id(fn) (the entry holds fn, so the id is not reused): hashing a JITFunction takes a lock
and its `cache_key` property, ~1.4 us a lookup against ~0.2 us for an int (timeit, CPU)."""


def _keyword_plan(fn: Any, num_args: int, names: tuple[str, ...]) -> tuple | None:
    """How a call with `num_args` positional arguments and keyword arguments `names` fills the
    parameters after them: for each, (its keyword, None) or (None, its default); None where the call
    does not map onto `FastLaunch` (an unknown keyword, a parameter both positional and named, a missing
    parameter without default, another launch option than num_warps / num_stages / launch_pdl)."""
    params = getattr(fn, "params", None)
    if params is None:
        return None
    param_names = [p.name for p in params]
    if any(name not in _LAUNCH_OPTIONS and name not in param_names[num_args:] for name in names):
        return None
    plan = []
    for param in params[num_args:]:
        if param.name in names:
            plan.append((param.name, None))
        elif getattr(param, "has_default", False):
            plan.append((None, param.default))
        else:
            return None
    return tuple(plan)


def launch_kernel(fn: Any, grid: tuple, *args: Any, **kwargs: Any) -> None:
    """`fn[grid](*args, **kwargs)` through one shared `FastLaunch` of `fn`: keyword parameters
    (constexprs) are put in signature order and defaults filled in, and the launch options num_warps,
    num_stages and launch_pdl passed on. Why: the fused per-layer kernels (norms, RoPE, SiLU) are
    launched with keywords, and through Triton's own `JITFunction.run` each launch costs tens of
    microseconds of binding and key building; a start-up's graph captures run them thousands of times
    (py-spy of a warm Qwen3-0.6B start-up: JITFunction.run ~18% of the captures). A call that does not
    map onto the fast path, or inside `compile_ahead.queuing_launches`, takes `compile_ahead.launch`
    with its arguments as given."""
    entry = _launchers.get(id(fn))
    if entry is None:
        entry = _launchers[id(fn)] = _KeywordLauncher(fn)
    plan_key = (len(args), *kwargs)
    plan = entry.plans.get(plan_key, entry.plans)
    if plan is entry.plans:
        plan = entry.plans[plan_key] = _keyword_plan(fn, len(args), tuple(kwargs))
    launcher = entry.launcher
    if plan is None or _ahead._active or not launcher.enabled:
        _ahead.launch(fn, grid, *args, **kwargs)
        return
    full = args + tuple(kwargs[name] if name is not None else default for name, default in plan)
    launcher(grid, *full, device_index=_current_device(), num_warps=kwargs.get("num_warps", 4),
             num_stages=kwargs.get("num_stages", 3), launch_pdl=kwargs.get("launch_pdl", False))


@functools.cache
def _sm_count(device_index: int) -> int:
    import torch
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_sms(device) -> int:
    """SMs of a CUDA device (a torch.device; index None = the current one): how the kernels here
    size their grids (programs per SM). Cached per device index."""
    import torch
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())
