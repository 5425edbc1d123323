"""Graph calls from several threads: one at a time (graph.py's lock), so that one thread's trace
(hooks on the shared modules, torch.export's patched global state) is never seen by another."""

from __future__ import annotations

import threading

import torch
from torch import nn

from tests.conftest import ModuleGraph


def _run_in_threads(*targets) -> list[BaseException]:
    errors: list[BaseException] = []

    def guarded(target):
        def run():
            try:
                target()
            except BaseException as e:  # noqa: BLE001  (reported by the test)
                errors.append(e)
        return run

    threads = [threading.Thread(target=guarded(t)) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def test_a_compiled_graph_runs_while_another_thread_compiles_over_the_same_modules() -> None:
    """Before: the compiled graph's calls saw the other thread's tracing hooks, traced again at
    the same time and failed inside torch.export ("Trying to pop empty mode stack"), and the
    compiling thread failed too."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 24), nn.Tanh(), nn.Linear(24, 6)).eval()
    compiled, x = ModuleGraph(model), torch.randn(4, 12)
    expected = model(x).detach()
    compiled(x)
    done = threading.Event()
    wrong = []

    def call_compiled():
        while not done.is_set():
            wrong.append(not torch.allclose(compiled(x), expected, atol=1e-5))

    def compile_others():
        try:
            for batch in (2, 3, 5):
                xb = torch.randn(batch, 12)
                assert torch.allclose(ModuleGraph(model)(xb), model(xb).detach(), atol=1e-5)
        finally:
            done.set()

    assert _run_in_threads(call_compiled, compile_others) == []
    assert wrong and not any(wrong) and compiled.num_compiled == 1


def test_first_calls_of_one_graph_from_three_threads_compile_once() -> None:
    model = nn.Linear(5, 3)
    graph, x = ModuleGraph(model), torch.randn(2, 5)
    results = []
    assert _run_in_threads(*[lambda: results.append(graph(x))] * 3) == []
    assert len(results) == 3 and all(torch.allclose(r, model(x).detach(), atol=1e-6) for r in results)
    assert graph.num_compiled == 1
