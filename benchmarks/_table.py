"""The tables the benchmark cases print: value, ratio to raw optax, and each case's own figures."""

from __future__ import annotations

from collections.abc import Sequence

from benchmarks._common import Row

# The extra figures each case's table shows beside the value and the ratio.
NOTES: dict[str, Sequence[tuple[str, str]]] = {
    "train_step": (("p25_ms", "p25 {:.2f}"), ("p75_ms", "p75 {:.2f}"), ("total_s", "compile {:.1f} s")),
    "optimizer_only": (("p25_ms", "p25 {:.2f}"), ("p75_ms", "p75 {:.2f}"), ("pytree_us", "pytree {:.0f} us")),
    "eager_update": (("p25_ms", "p25 {:.2f}"), ("p75_ms", "p75 {:.2f}")),
    "compile_time": (("trace_s", "trace {:.2f}"), ("lower_s", "lower {:.2f}"), ("compile_s", "XLA {:.2f}")),
    "memory": (
        ("argument_size_in_bytes", "args {:,}"),
        ("output_size_in_bytes", "out {:,}"),
        ("temp_size_in_bytes", "temp {:,}"),
        ("alias_size_in_bytes", "alias {:,}"),
    ),
    "retraces": (
        ("first_step_traces", "first step: {} traced"),
        ("compiles", "later compiles {}"),
        ("max_abs_diff_to_optax", "|params - optax| {:.1e}"),
    ),
    "gpu_bandwidth": (("median_ms", "{:.2f} ms/step"), ("device", "{}")),
    "lowbit_maps": (("vs_float32", "x float32 {:.4f}"),),
    "lowbit_speed": (("vs_baseline", "x baseline {:.2f}"), ("p25_ms", "p25 {:.2f}"), ("p75_ms", "p75 {:.2f}")),
    "gpu_lowbit": (
        ("median_ms", "{:.2f} ms/step"),
        ("time_vs_float32", "x float32 moments {:.3f}"),
        ("lower_bound_bytes", "{:,.0f} bytes moved at least"),
        ("device", "{}"),
    ),
    "many_leaves": (("peak_mib", "peak RSS {:,.0f} MiB"), ("init_s", "init {:.2f} s"), ("error", "{}")),
    "nnx_loop": (
        ("vs_nnx_optimizer", "x nnx.Optimizer {:.3f}"),
        ("same_losses", "same losses: {}"),
        ("first_call_s", "first call {:.1f} s"),
    ),
    "muon": (
        ("time_vs_one_device", "x one device {:.2f}"),
        ("collectives", "{} collectives"),
        ("collectives_in_loops", "{} in loops"),
        ("bytes_vs_params", "moved {:.2f}x params"),
        ("flops_vs_one_device", "FLOPs/device x one device {:.3f}"),
        ("remat_warnings", "{} remat warnings"),
        ("max_abs_diff_to_one_device", "max |diff| {:.1e}"),
        ("error", "{}"),
    ),
    "gpu_muon": (("time_vs_adamw", "x AdamW {:.2f}"), ("matrices", "{} matrices"), ("device", "{}")),
    "zero": (
        ("state_vs_replicated", "x replicated {:.3f}"),
        ("median_ms", "step {:.1f} ms"),
        ("time_vs_replicated", "time x replicated {:.2f}"),
        ("peak_mib", "peak RSS {:,.0f} MiB"),
        ("error", "{}"),
    ),
    "mixed_precision": (
        ("vs_float32_zero", "x float32 ZeRO-1 {:.3f}"),
        ("p25_ms", "p25 {:.1f}"),
        ("p75_ms", "p75 {:.1f}"),
        ("mib_device0", "params + state {:.2f} MiB/device"),
        ("bytes_per_param", "{:.3f} B/param"),
        ("arithmetic_bytes_per_param", "arithmetic {:.3f}"),
        ("loss", "loss {}"),
        ("moved", "moved {:.1%}"),
        ("error", "{}"),
    ),
    "ema": (
        ("vs_treeopt", "x treeopt {:.3f}"),
        ("vs_treeopt_pass1", "pass 1 {:.3f}"),
        ("vs_treeopt_pass2", "pass 2 {:.3f}"),
        ("p25_ms", "p25 {:.1f}"),
        ("p75_ms", "p75 {:.1f}"),
        ("mib_device0", "{:.2f} MiB/device"),
        ("master_bytes_per_param", "masters {:.3f} B/param"),
        ("ema_leaves_split", "{} leaves split"),
        ("error_step_10", "step 10: {:.1e}"),
        ("error_step_100", "step 100: {:.1e}"),
        ("moved", "moved from its start {:.1%}"),
        ("error", "{}"),
    ),
    "memory_ladder": (
        ("optimizer_bytes_per_param", "optimizer {:.3f} B/param"),
        ("zero_bytes_per_param_device0", "ZeRO-1 {:.3f} B/param/device"),
        ("final_loss", "loss {:.4f}"),
        ("loss_vs_float32", "x float32 loss {:.4f}"),
        ("held_out_loss", "held-out {:.4f}"),
        ("time_vs_float32", "x float32 time {:.3f}"),
        ("goal", "{}"),
        ("zero_error", "ZeRO-1: {}"),
        ("error", "{}"),
    ),
}


def _value(row: Row) -> str:
    if row.value is None:
        return "-"
    if row.unit in ("ms", "s"):
        return f"{row.value:.3f} {row.unit}" if row.value < 10 else f"{row.value:.1f} {row.unit}"
    if row.unit == "MiB":
        return f"{row.value:.2f} MiB"
    if row.unit == "B/param":
        return f"{row.value:.3f} B/param"
    if row.unit == "traces":
        return f"{row.value:.0f}"
    if row.unit in ("loss", "rel. L2"):  # values near 1 or below, compared in their third digit
        if row.value != 0 and abs(row.value) < 1e-3:  # an error by orders of magnitude smaller
            return f"{row.value:.2e} {row.unit}"
        return f"{row.value:.4f} {row.unit}"
    return f"{row.value:.1f} {row.unit}"


def _notes(row: Row) -> str:
    parts = []
    for key, fmt in NOTES.get(row.case, ()):
        if key in row.extra and row.extra[key] is not None:
            parts.append(fmt.format(row.extra[key]))
    return ", ".join(parts)


def table(rows: Sequence[Row], markdown: bool = False) -> str:
    """The rows of one case as a table: config, variant, value, ratio to raw optax, notes."""
    header = ["config", "variant", "value", "x optax", "notes"]
    body = [
        [
            r.config,
            r.variant,
            _value(r),
            f"{r.ratio:.3f}" if r.ratio is not None else "-",
            _notes(r),
        ]
        for r in rows
    ]
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        # A "|" inside a cell (e.g. "|params - optax|") would end the cell early.
        lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |" for cells in body]
        return "\n".join(lines)
    widths = [max(len(c[i]) for c in [header, *body]) for i in range(len(header))]
    fmt = "  ".join(f"{{:{'<' if i < 2 else '>'}{w}}}" for i, w in enumerate(widths[:-1])) + "  {}"
    lines = [fmt.format(*header), fmt.format(*("-" * w for w in widths[:-1]), "-----")]
    lines += [fmt.format(*cells) for cells in body]
    return "\n".join(lines)
