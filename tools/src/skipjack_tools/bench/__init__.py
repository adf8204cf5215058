"""``skipjack bench``: the benchmark suite (see docs/performance.md).

Modules: :mod:`.command` (the CLI), :mod:`.runner` (runs the scenarios, gathers the JSON),
:mod:`.ceiling` (skipjack's SQL with no framework, and pgbench), :mod:`.enqueue` (W1),
:mod:`.drain` (W2, W4, memory), :mod:`.latency` (W3, W5), :mod:`.claim_methods` (W6),
:mod:`.retry_storm` (W7), :mod:`.history` (W8), :mod:`.report` (ratios, targets, tables),
:mod:`.plot` (the PNG), :mod:`.peers` (other queues, each in its own virtualenv).
"""
