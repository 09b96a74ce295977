"""Every number the doctor judges by, each with the reason it was chosen.

`docs/doctor.md` explains them at length; keep the two in step. Thresholds are relative to the
SLA or to capacity wherever possible, so one set works for a 2-core laptop and a GPU fleet.
"""

from __future__ import annotations

# --- the symptom -------------------------------------------------------------------------------
SLA_DEFAULT_S = 0.15
"""Runbook SLA; used only when the server exports no `tailguard_sla_seconds` and --sla is absent."""
SLA_TARGET_SHARE = 0.99
"""The SLA gate of docs/metrics.md: bucket{le=SLA}/count >= 0.99; below it the window has a tail."""
MIN_REQUESTS = 20
"""Fewer requests than this: shares move >5% per request, so no tail is judged and starvation (the
rule that leans on shares) is demoted; configuration signals (a cap hit, a retry) still count."""

# --- allocator fragmentation ---------------------------------------------------------------------
ALLOC_RETRIES_MIN = 1
"""Any cudaMalloc retry means the caching allocator freed its cache and retried: a stall of ms."""
DEVICE_ALLOCS_GROWTH_MIN = 8
"""After warm-up a block pool + shape buckets make ~0 cudaMallocs; 8 allows a late lazy buffer."""
RESERVED_GAP_RATIO = 0.30
"""(reserved - allocated) / reserved above 30%: cached but unusable memory, typical of splits."""
RESERVED_GAP_MIN_BYTES = 256 * 1024 * 1024
"""Ignore gaps under 256 MiB: allocator rounding on a small model is not fragmentation."""
INACTIVE_SPLIT_RATIO = 0.10
"""Inactive split blocks over 10% of reserved: freed pieces of big blocks that nothing reuses."""
NEW_SHAPES_MIN = 1
"""Bucketed forwards add no shape after warm-up; one new shape means unbucketed input reached it."""

# --- dispatcher / thread starvation -------------------------------------------------------------
LOOP_LAG_SLA_FRACTION = 1 / 3
"""Lag beyond a third of the SLA (50 ms at 150 ms, a lag bucket) eats the budget before any work."""
LOOP_LAG_SLOW_SHARE = 0.01
"""More than 1% of lag samples over that bound: the loop stalls repeatedly, not once."""
OVERSUBSCRIPTION_RATIO = 1.5
"""Compute (or runnable) threads over 1.5x cores: each waits a third of the time for a core;
tailguard's own layout (engine threads = cores, front-end 1) stays under it."""
GC_SHARE = 0.05
"""GC pauses over 5% of wall time: each pause stops every request on that process."""
CPU_SATURATION = 0.90
"""Processes using over 90% of the host's cores: runnable threads wait for a core."""

# --- queueing (shared by starvation and overload) ----------------------------------------------
QUEUE_SLA_FRACTION = 0.5
"""A request that queues for half the SLA cannot meet it after a normal service time."""
QUEUE_SLOW_SHARE = 0.05
"""More than 5% of requests queueing that long explains a missed 99% SLA share."""
BATCH_FULL_RATIO = 0.80
"""Mean batch at 80% of max_num_seqs: the engine runs at capacity; faster dispatch cannot help."""
ENGINE_BUSY_RATIO = 0.50
"""Engine stepping over half the window while requests wait in its own queue: its scheduler would
have batched them if the budget allowed, so it is at capacity (token-bound batches included)."""

# --- plain overload ----------------------------------------------------------------------------
REJECT_SHARE = 0.01
"""Over 1% of requests refused (overloaded/expired/503/429): demand exceeds what is admitted."""
OFFERED_OVER_CAPACITY = 1.5
"""Offered rate 1.5x the measured capacity with a saturated engine and a growing queue: demand
explains the queue whatever else slowed the engine, so overload is ranked first."""
WAITING_MIN = 8
"""A waiting queue under 8 is scheduling jitter, not a backlog."""

# --- connection churn ----------------------------------------------------------------------------
CX_PER_REQUEST = 0.05
"""Keep-alive closes ~0 connections per request; over one closed (or replaced) per 20 is churn."""
TLS_PER_REQUEST = 0.05
"""Same bound for TLS handshakes: each costs a round trip plus key exchange CPU."""
MAX_REQUESTS_HIT_MIN = 1
"""A per-connection request cap being hit at all means connections are closed on purpose."""
SLOW_NEW_CX_MIN = 5
"""At least 5 requests that connection set-up alone pushed over the SLA (one or two are noise)."""

# --- noisy neighbour ---------------------------------------------------------------------------
NEIGHBOUR_CPU_SHARE = 0.40
"""Processes that are not the servers using over 40% of the host's cores: with the servers'
own work on top the cores are contended (2 cores: 0.8 of a core taken by others)."""
RUNQ_WAIT_SHARE = 0.10
"""The servers' threads waiting for a core over 0.1 s per second (schedstat): every request's
compute and every event-loop turn is delayed that much by whoever holds the cores."""

# --- GC pauses ------------------------------------------------------------------------------------
GC_MISS_SHARE = 0.02
"""GC pauses over 2% of wall time while the SLA is missed: with pauses of 10-100 ms that is
one stop every second or so, enough to push the slowest 1% past a 150 ms budget."""

# --- KV-pool exhaustion -------------------------------------------------------------------------
PREEMPT_PER_REQUEST = 0.01
"""Preemptions (sequences evicted and recomputed for KV space) on over 1% of requests: each one
repeats a prefill and stalls its request; a pool sized for the load preempts ~never."""
KV_BOUND_FILL = 0.5
"""A batch under half of max_num_seqs while sequences are preempted and requests queue: the KV
pool, not compute or max_num_seqs, caps the batch (more blocks would raise the capacity, more
cores would not)."""
KV_USAGE_FULL = 0.95
"""KV usage at 95%+ of the pool at a window end: the next long prompt preempts someone."""

# --- prefill-heavy traffic ------------------------------------------------------------------------
PREFILL_TOKENS_PER_SEQ = 256.0
"""Tokens per sequence per step (batch tokens / batch sequences) over 256: steps are long
prompts (a decode step is 1 token per sequence; a short single-pass request is its prompt, tens
of tokens), so every request behind them waits a whole step per chunk."""
PREFILL_STEP_SLA_FRACTION = 0.25
"""Mean engine step over a quarter of the SLA: four steps (queue, prefill, decode) exhaust it."""
PROMPT_TOKENS_LONG = 1024.0
"""vLLM: mean prompt over 1024 tokens and prompts over 8x the generated tokens: the traffic is
prefill-bound."""

# --- admission mis-calibration -------------------------------------------------------------------
PREDICTION_LATE_SHARE = 0.05
"""Over 5% of admitted requests later than admission planned (prediction ratio > 1): the cost
model is optimistic, so admitted work misses its deadline instead of being refused."""
PREDICTION_LATE_MIN = 5
"""And at least 5 such requests: in a small window 2-3 late of ~45 are noise (a ~2% late rate,
a 2-core host's hiccup) that crossed the share alone, as the lab's healthy run once read."""
PREDICTION_HELD_MIN = 0.5
"""Ratio under 0.5 for most admitted requests while refusing: admission plans twice the time
work takes and refuses requests that would have made it."""

CX_CLOSED_MIN = 10
"""Per-request connection rates count only with 10+ connections closed in the window: a client
that finished and closed its few pooled connections is not churn."""

# --- confidence ----------------------------------------------------------------------------------
DECODE_SLOWDOWN = 3.0
"""vLLM admits a flood into its running batch instead of a waiting queue (no queue to read):
per-token time in the window over 3x the server's own mean before it says the batch outgrew the
hardware. A batch that grows from 1 to 8 on a CPU costs well under 2x per token."""
CAUSE_MIN_CONFIDENCE = 0.5
"""A finding at or above this is named as a cause (exit 1); below it is reported as a note."""
