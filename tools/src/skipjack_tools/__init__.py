"""skipjack-tools: the demo, the fault-injection run and the benchmarks of skipjack.

A distribution of its own, which the library never imports: ``skipjack demo``, ``skipjack
chaos`` and ``skipjack bench`` load their commands from here when they are invoked.

Modules: :mod:`.commands` (the ``demo`` and ``chaos`` commands), :mod:`.demo` (webhook
delivery to a flaky receiver), :mod:`.chaos` (a workload under injected faults, then an
audit), :mod:`.bench` (the benchmark suite and its ``bench`` command), :mod:`.ha` (a
throwaway Patroni cluster for the failover test), :mod:`.sql` (the SQL only these tools run).
"""
