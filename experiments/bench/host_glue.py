"""Host time of the public ops' glue (checks, autograd, dispatch), the Triton launchers mocked.

    python -m experiments host-glue [--calls 500] [--repeats 7]

Per op, the best and median of the repeats in microseconds per call, forward alone and forward
+ backward, on this machine's CPU (``TRITON_INTERPRET=1`` is set here).
"""

from __future__ import annotations

import os
import statistics
import time
from contextlib import ExitStack
from unittest import mock

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from experiments import parser  # noqa: E402

T, H, D, B, N, K = 64, 2, 32, 4, 32, 8
LENGTHS = (10, 20, 10, 24)


def _mocks() -> dict[str, object]:
    """Launcher path -> a stand-in returning new tensors of the launcher's output shapes."""
    e = torch.empty
    return {
        "kernels._flash_attention_triton.flash_attention_fwd": lambda *a: (e(T, H, D), e(H, T)),
        "kernels._flash_attention_triton.flash_attention_bwd": lambda *a: (e(T, H, D),) * 3,
        "kernels._dense_attention_triton.dense_attention_fwd": lambda *a: (e(B, 1, H, D), e(H, B, 1)),
        "kernels._dense_attention_triton.dense_attention_bwd": lambda *a: (e(B, 1, H, D), e(T, H, D),
                                                                           e(T, H, D), None),
        "kernels._softmax_triton.jagged_softmax_fwd_triton": lambda *a: e(T, K),
        "kernels._softmax_triton.jagged_softmax_bwd_triton": lambda *a: e(T, K),
        "kernels._bmm_triton.jagged_dense_bmm_triton": lambda *a: e(T, K),
        "kernels._bmm_triton.jagged_jagged_bmm_triton": lambda *a: e(B, K, K),
        "kernels._elementwise_triton.jagged_dense_elementwise_fwd_triton": lambda *a: e(T, K),
        "kernels._elementwise_triton.jagged_dense_elementwise_bwd_triton": lambda *a: (e(T, K), e(B, N, K)),
        "kernels._conversions_triton.jagged_to_padded_triton": lambda *a: e(B, N, K),
        "kernels._conversions_triton.padded_to_jagged_triton": lambda *a: e(T, K),
    }


def _cases(grad: bool) -> dict[str, callable]:
    import kernels as k

    off = torch.tensor([0, *LENGTHS]).cumsum(0)

    def t(*shape):
        return torch.randn(*shape, requires_grad=grad)

    q, kk, v, cq, x, w, dense, padded = t(T, H, D), t(T, H, D), t(T, H, D), t(B, 1, H, D), t(T, K), \
        t(B, K, K), t(B, N, K), t(B, N, K)
    calls = {
        "jagged_flash_attention": lambda: k.jagged_flash_attention(q, kk, v, off, N, backend="triton"),
        "jagged_dense_attention": lambda: k.jagged_dense_attention(cq, kk, v, off, N, backend="triton"),
        "jagged_softmax": lambda: k.jagged_softmax(x, off, N, backend="triton"),
        "jagged_dense_bmm": lambda: k.jagged_dense_bmm(x, off, w, N, backend="triton"),
        "jagged_jagged_bmm": lambda: k.jagged_jagged_bmm(x, x, off, N, backend="triton"),
        "jagged_dense_elementwise_mul": lambda: k.jagged_dense_elementwise_mul(x, off, dense, backend="triton"),
        "jagged_to_padded": lambda: k.jagged_to_padded(x, off, N, backend="triton"),
        "padded_to_jagged": lambda: k.padded_to_jagged(padded, off, total=T, backend="triton"),
    }
    if not grad:
        return calls
    return {name: (lambda f: lambda: f().sum().backward())(f) for name, f in calls.items()}


def _time(fn, calls: int, repeats: int) -> tuple[float, float]:
    for _ in range(calls // 4):
        fn()
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter() - t0) / calls * 1e6)
    return min(runs), statistics.median(runs)


def main(argv: list[str] | None = None) -> None:
    p = parser("host-glue", __doc__)
    p.add_argument("--calls", type=int, default=500, help="calls per timed repeat")
    p.add_argument("--repeats", type=int, default=7, help="timed repeats per op and mode")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    called: set[str] = set()

    def counted(target: str, fn):
        def stand_in(*a):
            called.add(target)
            return fn(*a)

        return stand_in

    with ExitStack() as stack:
        for target, fn in _mocks().items():
            stack.enter_context(mock.patch(target, counted(target, fn)))
        rows = [(name, _time(fwd, args.calls, args.repeats), _time(both, args.calls, args.repeats))
                for (name, fwd), both in zip(_cases(False).items(), _cases(True).values())]
    missed = sorted(set(_mocks()) - called)
    if missed:  # an op that never reached its launcher timed some other path
        raise RuntimeError(f"launchers never called (the ops took another path): {', '.join(missed)}")
    print(f"host us per call, launchers mocked (best / median of {args.repeats} x {args.calls}), torch {torch.__version__}")
    print("| op | forward | forward + backward |\n| --- | ---: | ---: |")
    for name, (f_best, f_med), (b_best, b_med) in rows:
        print(f"| {name} | {f_best:.1f} / {f_med:.1f} | {b_best:.1f} / {b_med:.1f} |")

