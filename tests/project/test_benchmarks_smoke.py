"""The benchmark suite runs end to end in --smoke mode (tiny sizes). Nothing here is timed."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from benchmarks import _common, ema, gpu_bandwidth, gpu_lowbit, gpu_muon, memory_ladder, run, train_step

CASE_VARIANTS = {
    "train_step": {"optax", "treeopt", "TrainState", "nnx split/merge", "nnx.jit"},
    "optimizer_only": {"optax", "treeopt"},
    "eager_update": {"optax", "treeopt", "nnx.Optimizer", "optax (jax.jit)"},
    "compile_time": {"optax", "treeopt"},
    "memory": {"optax", "treeopt"},
    "retraces": {"optax", "treeopt", "treeopt (eager)"},
    "many_leaves": {"optax", "treeopt", "treeopt (eager)"},
    "nnx_loop": {
        "optax",
        "treeopt (jax.jit, split)",
        "nnx.Optimizer (split/merge)",
        "treeopt (nnx.jit)",
        "nnx.Optimizer (nnx.jit)",
        "treeopt (cached_partial)",
        "nnx.Optimizer (cached_partial)",
        "treeopt.nnx (split/merge)",
        "treeopt.nnx (nnx.jit)",
        "treeopt.nnx (cached_partial)",
    },
    "zero": {"replicated state", "ZeRO over data"},
    "mixed_precision": {
        "optax",
        "bf16 + f32 masters, ZeRO-1",
        "float32, ZeRO-1",
        "bf16, no masters, ZeRO-1",
    },
}


def rows(results: dict, case: str) -> list[dict]:
    return results["cases"][case]["rows"]


def check_every_variant_is_measured_beside_optax(results: dict) -> None:
    for case, variants in CASE_VARIANTS.items():
        measured = rows(results, case)
        assert {r["variant"] for r in measured} == variants, case
        for r in measured:
            assert math.isfinite(r["value"]) and r["value"] >= 0, r
            if r["variant"] == "optax" and case != "retraces":
                assert r["ratio_to_optax"] == 1.0


def check_timings_are_medians_of_every_step(results: dict) -> None:
    for r in rows(results, "train_step"):
        assert r["p25_ms"] <= r["value"] <= r["p75_ms"], r
        # rounds x steps per round of the smoke profile; optax and treeopt are timed in
        # two passes (each compiled first once) and their samples pooled.
        passes = 2 if r["variant"] in ("optax", "treeopt") else 1
        assert r["n"] == passes * 2 * 2, r
        if r["variant"] != "nnx.jit":  # nnx.jit compiles on its first call; the others ahead of time
            assert r["total_s"] == pytest.approx(r["trace_s"] + r["lower_s"] + r["compile_s"])


def check_no_retrace_after_the_first_step(results: dict) -> None:
    for r in rows(results, "retraces"):
        assert r["first_step_traces"] >= 1, "the compile log was not captured"
        assert r["value"] == 0 and r["compiles"] == 0, r
        assert r["max_abs_diff_to_optax"] < 1e-6
        assert r["final_learning_rate"] < 1e-3  # the changes took effect


def check_treeopt_step_allocates_no_extra_copy(results: dict) -> None:
    by_variant = {r["variant"]: r for r in rows(results, "memory")}
    optax_, treeopt_ = by_variant["optax"], by_variant["treeopt"]
    assert treeopt_["temp_size_in_bytes"] == optax_["temp_size_in_bytes"]
    # treeopt's own int32 step counter is the only extra state (plus its tuple slot).
    assert 0 <= treeopt_["output_size_in_bytes"] - optax_["output_size_in_bytes"] <= 16


def check_many_leaves_ran_each_variant_in_its_own_process(results: dict) -> None:
    for r in rows(results, "many_leaves"):
        assert "error" not in r, r
        assert r["peak_mib"] > 50 and r["init_s"] >= 0, r  # a process that imported JAX


def check_nnx_loop_variants_train_the_same_numbers(results: dict) -> None:
    for r in rows(results, "nnx_loop"):
        assert r["same_losses"] is True, r  # bit for bit, nnx.Optimizer's first losses
        assert ("vs_nnx_optimizer" in r) == r["variant"].startswith("treeopt"), r


def check_zero_splits_the_state_eight_ways(results: dict) -> None:
    by_variant = {r["variant"]: r for r in rows(results, "zero")}
    base, zero = by_variant["replicated state"], by_variant["ZeRO over data"]
    assert "error" not in base and "error" not in zero, (base, zero)
    assert zero["leaves_split"] > 0 and base["leaves_split"] == 0
    # Only adam's step count is left whole: the rest is 1/8 per device.
    assert zero["state_bytes_device0"] == (base["state_bytes_device0"] - 4) / 8 + 4
    assert zero["state_bytes_all_devices"] == base["state_bytes_all_devices"]
    assert zero["argument_size_in_bytes"] < base["argument_size_in_bytes"]


def check_mixed_precision_bytes_follow_the_arithmetic(results: dict) -> None:
    by_variant = {r["variant"]: r for r in rows(results, "mixed_precision")}
    for r in by_variant.values():
        assert "error" not in r, r
        # Per param: 2 + 12/8 (bf16, f32 masters and moments split 8 ways), 4 + 8/8, 12, 2 + 4/8;
        # beyond that only the int32 step counts (adam's, and treeopt's own).
        extra = r["bytes_device0"] - r["arithmetic_bytes_per_param"] * r["n_params"]
        assert extra == (4 if r["variant"] == "optax" else 8), r
        assert math.isfinite(r["final_loss"]) and r["final_loss"] > 0, r
    masters = by_variant["bf16 + f32 masters, ZeRO-1"]
    assert [r["arithmetic_bytes_per_param"] for r in by_variant.values()] == [12, 3.5, 5, 2.5]
    assert masters["master_bytes_device0"] * 8 == 4 * masters["n_params"]
    assert by_variant["float32, ZeRO-1"]["master_bytes_device0"] == 0  # float32 params get no copy
    # The same numbers: ZeRO-1 on float32 params fine-tunes like raw optax.
    float32, optax_ = by_variant["float32, ZeRO-1"], by_variant["optax"]
    assert float32["final_loss"] == pytest.approx(optax_["final_loss"], rel=1e-6)


def check_memory_ladder_bytes_follow_the_arithmetic(results: dict) -> None:
    by_variant = {r["variant"]: r for r in rows(results, "memory_ladder")}
    assert set(by_variant) == set(memory_ladder.variants())
    f32 = by_variant["float32 AdamW"]
    counts = f32["optimizer_bytes"] - 8 * f32["n_params"]  # adamw's int32 counts and treeopt's step
    assert 0 < counts <= 16, f32
    for r in by_variant.values():
        assert "error" not in r and "zero_error" not in r, r
        n = r["n_params"]
        assert r["value"] == r["bytes_per_param"] == (r["params_bytes"] + r["optimizer_bytes"]) / n
        assert r["spec"]["param_dtype"] == memory_ladder.variants()[r["variant"]][0]
        assert r["params_bytes"] == (2 if r["spec"]["param_dtype"] == "bfloat16" else 4) * n, r
        check_memory_ladder_parts(r)
        assert "final_loss" not in r  # smoke trains nothing: the bytes of a fresh state
        # ZeRO-1: the params replicated, the optimizer split as far as its leaves' shardings go.
        assert r["zero_params_bytes_device0"] == r["params_bytes"]
        assert r["zero_optimizer_bytes_device0"] <= r["optimizer_bytes"]
        bits = memory_ladder.variants()[r["variant"]][2]
        if bits is None:
            assert r["lowbit_bytes"] == 0
            # Every full-precision leaf splits 8 ways but the int32 step counts (and a rounding key).
            unsplit = counts + (8 if "stochastic" in r["variant"] else 0)
            assert r["zero_optimizer_bytes_device0"] == (r["optimizer_bytes"] - unsplit) / 8 + unsplit, r
        else:
            # Per param, Adam's two moments as codes (1 or 1/2 byte) and a float32 scale per block.
            per_param = 2 * r["lowbit_bytes_per_element"]
            assert per_param <= {8: 2.1, 4: 1.1}[bits], r
            assert r["lowbit_elements"] > 0.9 * 2 * n  # all but the small leaves
    masters = by_variant["bf16 + f32 master"]
    # Masters add 4 bytes per param, and the moments they train are the same.
    assert masters["master_bytes"] == 4 * masters["n_params"]
    assert masters["optimizer_bytes"] - f32["optimizer_bytes"] == 4 * f32["n_params"]
    low, f32_low = by_variant["bf16 + master + 8-bit"], by_variant["float32 + 8-bit"]
    assert low["optimizer_bytes"] - f32_low["optimizer_bytes"] == 4 * f32["n_params"]
    assert by_variant["bf16 + master + 4-bit"]["optimizer_bytes"] < low["optimizer_bytes"]


def check_memory_ladder_parts(r: dict) -> None:
    """The figure's parts add up to what the variant holds, each where its option puts it."""
    parts, spec, n = r["parts_bytes"], r["spec"], r["n_params"]
    assert parts["other"] == 0, r  # every byte of the optimizer is one of the named parts
    assert sum(parts.values()) == r["params_bytes"] + r["optimizer_bytes"], r
    assert parts["params"] == r["params_bytes"] and parts["master"] == r["master_bytes"], r
    assert parts["master"] == (4 * n if spec["master_dtype"] == "float32" else 0), r
    # Kahan: a buffer in the params' dtype, as large as the params; stochastic rounding: one key.
    assert parts["compensation"] == (r["params_bytes"] if spec["param_rounding"] == "kahan" else 0), r
    assert parts["rounding_key"] == (8 if spec["param_rounding"] == "stochastic" else 0), r
    assert 8 <= parts["counts"] <= 16, r  # adamw's int32 counts and treeopt's step
    if spec["state_bits"] is None:
        # Two moments a param: in the params' dtype without an option (optax's choice), else float32.
        plain = spec["master_dtype"] is None and spec["param_rounding"] is None
        assert parts["moments"] == 2 * n * (r["params_bytes"] // n if plain else 4), r
    else:
        assert parts["moments"] < 2.2 * n, r  # codes and scales, and the small leaves in full


def check_ema_average_is_float32_split_like_the_masters_and_exact(results: dict) -> None:
    by_variant = {r["variant"]: r for r in rows(results, "ema")}
    assert set(by_variant) == {*ema.VARIANTS, *ema.LAYOUTS, *ema.AVERAGES.values()}
    for r in by_variant.values():
        assert "error" not in r and math.isfinite(r["value"]) and r["value"] >= 0, r
    assert by_variant["optax"]["ratio_to_optax"] == 1.0
    assert by_variant[ema.WITH_EMA]["vs_treeopt"] > 0
    # float32: 4 bytes a param replicated, an eighth of it on each device under ZeRO-1, as the masters.
    replicated, zero = by_variant["replicated"], by_variant["ZeRO-1 over data"]
    assert replicated["value"] == 4.0 and zero["value"] == 0.5, (replicated, zero)
    assert all(r["master_bytes_per_param"] == r["value"] for r in (replicated, zero))
    assert zero["ema_leaves_split"] == zero["ema_leaves"]
    # Against the float64 average of the masters: treeopt's to float32 rounding, the bf16 one far off.
    ours, bf16 = (by_variant[label]["value"] for label in ema.AVERAGES.values())
    assert ours < 1e-5 and bf16 > 10 * ours, (ours, bf16)


def check_gpu_case_skips_cleanly_without_a_gpu(results: dict) -> None:
    for case in ("gpu_bandwidth", "gpu_lowbit", "gpu_muon"):
        first, *_ = rows(results, case)
        if first["variant"].startswith("no GPU"):
            assert first["value"] is None
        else:
            assert first["value"] > 0


@pytest.mark.slow  # a minute of compiling: the slow tier (-m slow) runs it
def test_smoke_run_measures_every_case(tmp_path: Path) -> None:
    # One test for the whole run: the suite compiles a few dozen small programs.
    returned = run.main(["--smoke", "--silent", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "latest.json").read_text())
    assert saved["profile"] == "smoke" and returned["path"].startswith(str(tmp_path))
    assert set(saved["cases"]) == set(run.CASES)
    check_every_variant_is_measured_beside_optax(saved)
    check_timings_are_medians_of_every_step(saved)
    check_no_retrace_after_the_first_step(saved)
    check_treeopt_step_allocates_no_extra_copy(saved)
    check_gpu_case_skips_cleanly_without_a_gpu(saved)
    check_many_leaves_ran_each_variant_in_its_own_process(saved)
    check_nnx_loop_variants_train_the_same_numbers(saved)
    check_zero_splits_the_state_eight_ways(saved)
    check_mixed_precision_bytes_follow_the_arithmetic(saved)
    check_memory_ladder_bytes_follow_the_arithmetic(saved)
    check_ema_average_is_float32_split_like_the_masters_and_exact(saved)


@pytest.mark.slow  # compiles four train steps in a fresh process: the slow tier (-m slow) runs it
def test_smoke_run_of_the_ema_case(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def draw(*_: object, **__: object) -> None:
        raise AssertionError("--smoke draws no figure")

    monkeypatch.setattr(ema, "draw", draw)
    run.main(["--smoke", "--silent", "--cases", "ema", "--out", str(tmp_path)])
    check_ema_average_is_float32_split_like_the_masters_and_exact(
        json.loads((tmp_path / "latest.json").read_text())
    )


@pytest.mark.slow  # compiles the GPU case's programs on CPU: the slow tier (-m slow) runs it
def test_gpu_case_code_path_runs_on_any_backend() -> None:
    measured = gpu_bandwidth.run(_common.SMOKE, log=lambda _: None, force=True)
    assert [(r.config.split(",")[0], r.variant) for r in measured] == [
        ("adam", "optax"),
        ("adam", "treeopt"),
        ("adamw", "optax"),
        ("adamw", "treeopt"),
    ]
    for r in measured:
        assert r.value is not None and r.value > 0
        assert r.extra["lower_bound_bytes"] == gpu_bandwidth.BYTES_PER_PARAM * r.extra["n_params"]


@pytest.mark.slow  # compiles the GPU case's programs on CPU: the slow tier (-m slow) runs it
def test_gpu_lowbit_case_code_path_runs_on_any_backend() -> None:
    # One low-bit variant: each compiles for seconds on a CPU, and the loop is the same for all.
    measured = gpu_lowbit.run(_common.SMOKE, log=lambda _: None, force=True, variants=["4-bit moments"])
    assert [r.variant for r in measured] == ["4-bit moments"]
    for r in measured:
        assert r.value is not None and r.value > 0
        bits = r.extra["state_bits"]
        assert (
            r.extra["lower_bound_bytes"] == gpu_lowbit.lower_bound_bytes_per_param(bits) * r.extra["n_params"]
        )
    assert [gpu_lowbit.lower_bound_bytes_per_param(b) for b in (None, 8, 4)] == [28, 16.0625, 14.125]


@pytest.mark.slow  # compiles the GPU case's programs on CPU: the slow tier (-m slow) runs it
def test_gpu_muon_case_code_path_runs_on_any_backend() -> None:
    measured = gpu_muon.run(_common.SMOKE, log=lambda _: None, force=True)
    by_variant = {r.variant: r for r in measured}
    assert list(by_variant) == ["AdamW, all params", "Muon, all matrices", "Muon, one owner's share of 8"]
    assert all(r.value is not None and r.value > 0 for r in measured)
    everything, share = by_variant["Muon, all matrices"].extra, by_variant["Muon, one owner's share of 8"].extra
    # 2 layers of 4 attention and 3 MLP matrices over 8 owners: device 0 holds one or two of the 14.
    assert everything["matrices"] == 14 and 1 <= share["matrices"] <= 2


def test_markdown_table_has_one_line_per_row() -> None:
    table_rows = [
        _common.Row("c", "cfg", "optax", 2.0, "ms", 1.0),
        _common.Row("c", "cfg", "treeopt", 1.0, "ms", 0.5),
    ]
    lines = run.table(table_rows, markdown=True).splitlines()
    assert lines[0].startswith("| config | variant | value | x optax")
    assert lines[2:] == ["| cfg | optax | 2.000 ms | 1.000 |  |", "| cfg | treeopt | 1.000 ms | 0.500 |  |"]


def test_markdown_table_escapes_pipes_inside_cells() -> None:
    row = _common.Row("retraces", "cfg", "treeopt", 0.0, "traces", extra={"max_abs_diff_to_optax": 0.0})
    (line,) = run.table([row], markdown=True).splitlines()[2:]
    assert line.endswith(r"| \|params - optax\| 0.0e+00 |"), line


def test_unknown_case_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        run.main(["--smoke", "--cases", "nope"])
    assert "unknown case(s) ['nope']" in capsys.readouterr().err


def test_quick_runs_the_headline_cases_at_400_and_2000_leaves() -> None:
    profile, cases = run.choose(quick=True, smoke=False, cases=None)
    assert profile.name == "quick"
    assert cases == ["train_step", "eager_update", "memory", "retraces"]
    assert [config[0] for config in profile.train_configs] == [
        "400 leaves (200 x 64x64)",
        "2,000 leaves (1000 x 32x32)",
    ]
    assert profile.nnx  # nnx.Optimizer is timed beside treeopt in train_step
    assert run.choose(quick=True, smoke=False, cases="zero")[1] == ["zero"]
    assert set(profile.train_variants or ()) <= set(train_step.VARIANTS) and not profile.second_pass
    assert run.choose(quick=False, smoke=False, cases=None)[1] == list(run.CASES)


def test_quick_and_smoke_exclude_each_other(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        run.main(["--quick", "--smoke"])
    assert "not allowed with argument" in capsys.readouterr().err
