"""`zerorun bench comm` measures every implementation, the int8 ones included, with the calling thread's CPU
beside each time (a tiny buffer on loopback here; no timing asserts)."""

from __future__ import annotations

from zerorun.bench import comm


def test_bench_comm_measures_every_collective_and_what_it_costs_the_calling_thread() -> None:
    results = comm.run([0.25], world_size=2, repeats=1)
    implementations = {(r.operation, r.implementation) for r in results}
    assert {("reduce-scatter", "zerorun int8 (qgZ)"), ("all-gather", "zerorun int8 (qwZ)"),
            ("reduce-scatter", "zerorun"), ("all-gather", "zerorun")} <= implementations
    assert all(r.median_ms > 0 and r.caller_cpu_ms >= 0 for r in results)
    table = comm.render(results, 2)
    assert "caller's CPU ms" in [column.header for column in table.columns]
