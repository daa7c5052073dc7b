"""FastLaunch's logic on a CPU, with a fake JIT function standing in for Triton's (named Fake*):
which calls go through `fn[grid]` (compile / first launch of a specialisation), which reuse the
compiled kernel's C launcher, and that every input Triton specialises on changes the key.
The real launcher is checked against Triton's own path on a GPU (tests/test_triton_gpu.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from launch import fast_launch
from launch.fast_launch import FastLaunch


class FakeCompiledKernel:
    """Records the C-launcher calls the way Triton's CompiledKernel.run receives them."""

    def __init__(self) -> None:
        self.function, self.packed_metadata, self.runs = "fn-handle", "packed", []

    def run(self, *call):
        self.runs.append(call)


class FakeJITFunction:
    """params/device_caches like a JITFunction; `fn[grid](*args, **options)` returns a new
    FakeCompiledKernel per call and logs the slow-path call."""

    def __init__(self, kinds: list[str]) -> None:
        self.params = [SimpleNamespace(is_constexpr=k == "constexpr", do_not_specialize=k == "plain") for k in kinds]
        self.device_caches = {}
        self.slow_calls, self.kernels = [], []

    def __getitem__(self, grid):
        def launch(*args, **options):
            self.slow_calls.append((grid, args, options))
            kernel = FakeCompiledKernel()
            self.kernels.append(kernel)
            return kernel
        return launch


def _fake():
    fn = FakeJITFunction(["spec", "spec", "plain", "float", "constexpr"])
    return fn, FastLaunch(fn, stream_of=lambda index: 1000 + index)


def test_second_call_reuses_the_compiled_kernel_with_triton_arguments():
    fn, launch = _fake()
    x = torch.zeros(64)
    launch((3, 2), x, 32, 5, 0.5, 7, device_index=0, num_warps=4, num_stages=2)
    assert len(fn.slow_calls) == 1 and fn.slow_calls[0][2] == {"num_warps": 4, "num_stages": 2}
    launch((3, 2), x, 32, 9, 0.25, 7, device_index=0, num_warps=4, num_stages=2)  # plain int / float change: same key
    assert len(fn.slow_calls) == 1 and launch.fast_launches == 1
    (call,) = fn.kernels[0].runs
    assert call[:9] == (3, 2, 1, 1000, "fn-handle", "packed", None, None, None)
    assert call[9:] == (x, 32, 9, 0.25, 7)


@pytest.mark.parametrize("change", ["constexpr", "dtype", "alignment", "int_is_one", "int_divisibility",
                                    "int_64bit", "options", "pdl", "device"])
def test_every_specialisation_input_changes_the_key(change):
    fn, launch = _fake()
    base = torch.zeros(64)
    args = [base, 32, 5, 0.5, 7]
    options = dict(device_index=0, num_warps=4, num_stages=2)
    launch((1,), *args, **options)
    if change == "constexpr":
        args[4] = 8
    elif change == "dtype":
        args[0] = torch.zeros(64, dtype=torch.float16)
    elif change == "alignment":
        args[0] = base[1:]                           # 4 bytes past a 16-byte boundary
    elif change == "int_is_one":
        args[1] = 1
    elif change == "int_divisibility":
        args[1] = 33
    elif change == "int_64bit":
        args[2] = 2 ** 40                            # not specialised, but i64 is another signature
    elif change == "options":
        options["num_warps"] = 8
    elif change == "pdl":
        options["launch_pdl"] = True
    else:
        options["device_index"] = 1
    launch((1,), *args, **options)
    assert len(fn.slow_calls) == 2 and launch.fast_launches == 0


def test_launch_pdl_reaches_triton_only_when_set():
    """A compile option of Triton's CUDA backend: passed on when set, left out otherwise (the
    interpreter and older Tritons have no such option)."""
    fn, launch = _fake()
    launch((1,), torch.zeros(4), 32, 5, 0.5, 7, num_warps=4, num_stages=1, launch_pdl=True)
    launch((1,), torch.zeros(4), 32, 5, 0.5, 8, num_warps=4, num_stages=1)
    assert [call[2] for call in fn.slow_calls] == [{"num_warps": 4, "num_stages": 1, "launch_pdl": True},
                                                   {"num_warps": 4, "num_stages": 1}]


def test_disabled_by_the_switch_and_for_non_jit_functions(monkeypatch, kernel_switches):
    fn, launch = _fake()
    kernel_switches(fast_launch=False)   # KernelConfig.fast_launch (GRAPHRUNNER_FAST_LAUNCH=0)
    for _ in range(2):
        launch((1,), torch.zeros(4), 32, 5, 0.5, 7)
    assert len(fn.slow_calls) == 2 and launch.fast_launches == 0
    interpreted = SimpleNamespace(params=fn.params)  # Triton's interpreter: no device_caches
    assert not FastLaunch(interpreted).enabled


def test_wrong_argument_count_takes_the_ordinary_path():
    fn, launch = _fake()
    for _ in range(2):
        launch((1,), torch.zeros(4), 32, 5, 0.5)     # one short: Triton's binder reports the error
    assert len(fn.slow_calls) == 2


def test_an_active_launch_hook_takes_the_ordinary_path():
    knobs = pytest.importorskip("triton").knobs
    hook = knobs.runtime.launch_enter_hook
    if not hasattr(hook, "add"):
        pytest.skip("this Triton has no HookChain launch hooks")
    fn, launch = _fake()
    profiler = lambda metadata: None  # noqa: E731 - what a profiler registers
    hook.add(profiler)
    try:
        for _ in range(2):
            launch((1,), torch.zeros(4), 32, 5, 0.5, 7)
    finally:
        hook.remove(profiler)
    assert len(fn.slow_calls) == 2 and launch.fast_launches == 0


def test_generated_key_equals_the_generic_key_and_argument_types_that_differ_fall_back():
    fn, launch = _fake()
    x = torch.zeros(64)
    args = (x, 32, 2 ** 40, 0.5, 7)
    options = (0, 4, 2)
    assert launch._fast_key(args, options) == launch.key(args, options)
    other = (x, torch.zeros(2), 5, 0.5, 7)            # a tensor where the first call had an int
    assert launch._fast_key(other, options) == ("generic",) + launch.key(other, options)
    assert launch._fast_key(other, options) != launch._fast_key(args, options)


class FakeTritonLauncher:
    """Like Triton's CudaLauncher: `__call__(grid, stream, function, metadata, launch metadata, hooks,
    *args)` does Python work and then calls its C `launch` (an instance attribute) with the grid,
    the stream, a tail of its own and the kernel's arguments. `scratch` stands for a per-launch
    scratch allocation (then the direct path must not be offered)."""

    def __init__(self, scratch=None) -> None:
        self.scratch, self.launches = scratch, []
        self.launch = lambda *call: self.launches.append(call)

    def __call__(self, gx, gy, gz, stream, function, metadata, launch_metadata, enter, exit_, *args):
        self.launch(gx, gy, gz, stream, function, 0, 1, metadata, launch_metadata, enter, exit_, self.scratch, *args)


def _kernel_with(launcher):
    return SimpleNamespace(function="fn-handle", packed_metadata="packed", run=launcher)


def test_direct_launch_learns_the_tail_once_without_launching():
    _, launch = _fake()
    launcher = FakeTritonLauncher()
    kernel = _kernel_with(launcher)
    direct = launch.direct_launch(kernel, (3, 2), 1234)
    assert launcher.launches == []          # learning ran the Python launcher into a recorder only
    assert launch.direct_launch(kernel, (5,), 99) is not None and len(launch._launch_tails) == 1
    x = torch.zeros(4)
    direct(x, 32, 9, 0.25, 7)
    assert launcher.launches == [(3, 2, 1, 1234, "fn-handle", 0, 1, "packed", None, None, None, None,
                                  x, 32, 9, 0.25, 7)]
    launcher(3, 2, 1, 1234, "fn-handle", "packed", None, None, None, x, 32, 9, 0.25, 7)
    assert launcher.launches[0] == launcher.launches[1]   # exactly what Triton's own path passes


def test_direct_launch_is_refused_where_it_is_not_known_to_be_safe():
    _, launch = _fake()
    assert launch.direct_launch(_kernel_with(FakeTritonLauncher(scratch=torch.zeros(8))), (1,), 0) is None
    assert launch.direct_launch(_kernel_with(lambda *call: None), (1,), 0) is None   # no C `launch` to call

    class Reordering(FakeTritonLauncher):   # passes the arguments on in another order
        def __call__(self, gx, gy, gz, stream, function, metadata, launch_metadata, enter, exit_, *args):
            self.launch(gx, gy, gz, stream, function, *reversed(args))
    assert launch.direct_launch(_kernel_with(Reordering()), (1,), 0) is None


def test_compiled_kernel_looks_up_without_launching():
    """`compiled_kernel` (the PIECEWISE step graph plans the step's attention with it): the kernel a
    call with these arguments would relaunch, None before its first (compiling) call or for another
    key; nothing is launched either way."""
    fn, launch = _fake()
    x = torch.zeros(64)
    assert launch.compiled_kernel((x, 32, 5, 0.5, 7), num_warps=4, num_stages=2) is None
    launch((3, 2), x, 32, 5, 0.5, 7, device_index=0, num_warps=4, num_stages=2)
    kernel = fn.kernels[0]
    assert launch.compiled_kernel((x, 32, 9, 0.25, 7), num_warps=4, num_stages=2) is kernel   # same key
    assert launch.compiled_kernel((x, 33, 9, 0.25, 7), num_warps=4, num_stages=2) is None     # 33: another key
    assert launch.compiled_kernel((x, 32, 9, 0.25, 7), num_warps=8, num_stages=2) is None     # another option
    assert not kernel.runs and len(fn.slow_calls) == 1


def _keyword_fake(monkeypatch):
    """A fake kernel (x, n, BLOCK: constexpr, FLAG: constexpr = False) whose shared FastLaunch
    reads a fake stream, on device 0."""
    fn = FakeJITFunction(["spec", "spec", "constexpr", "constexpr"])
    for param, name in zip(fn.params, ["x", "n", "BLOCK", "FLAG"]):
        param.name, param.has_default, param.default = name, name == "FLAG", False
    monkeypatch.setitem(fast_launch._launchers, id(fn),
                        fast_launch._KeywordLauncher(fn, FastLaunch(fn, stream_of=lambda index: 1000 + index)))
    monkeypatch.setattr(fast_launch, "_current_device", lambda: 0)
    return fn


def test_launch_kernel_puts_keywords_in_signature_order_and_fills_defaults(monkeypatch):
    fn = _keyword_fake(monkeypatch)
    x = torch.zeros(64)
    for n in (32, 48):   # the same key: the second call relaunches the compiled kernel
        fast_launch.launch_kernel(fn, (2,), x, n, BLOCK=64, num_warps=8)
    assert fn.slow_calls == [((2,), (x, 32, 64, False), {"num_warps": 8, "num_stages": 3})]
    assert fn.kernels[0].runs == [(2, 1, 1, 1000, "fn-handle", "packed", None, None, None, x, 48, 64, False)]
    fast_launch.launch_kernel(fn, (2,), x, 32, FLAG=True, BLOCK=64, num_warps=8, launch_pdl=True)
    assert fn.slow_calls[-1] == ((2,), (x, 32, 64, True), {"num_warps": 8, "num_stages": 3, "launch_pdl": True})


@pytest.mark.parametrize("kwargs", [dict(BLOCK=64, maxnreg=32),      # a launch option FastLaunch does not pass
                                    dict(FLAG=True),                  # BLOCK missing, and it has no default
                                    dict(n=32, BLOCK=64)])            # n given positionally and by name
def test_launch_kernel_calls_that_do_not_map_take_tritons_path_as_given(monkeypatch, kwargs):
    fn = _keyword_fake(monkeypatch)
    x = torch.zeros(64)
    for _ in range(2):
        fast_launch.launch_kernel(fn, (2,), x, 32, **kwargs)
    assert fn.slow_calls == [((2,), (x, 32), kwargs)] * 2
    assert fast_launch._launchers[id(fn)].launcher.fast_launches == 0
