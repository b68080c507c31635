"""Case 11: mixed precision, bfloat16 params with float32 master weights and ZeRO-1, on 8 virtual CPU devices.

A small decoder-only transformer (token and position embeddings, pre-norm
blocks of causal multi-head attention and a GELU MLP with layer norms, a
final norm and an output head; plain JAX) is trained data-parallel over a
``data`` mesh of 8 devices, params and batch replicated, with a jitted,
donated step (forward, backward, optimizer update). The variants, built and
measured side by side in one process:

- ``optax``: float32 params, raw optax adamw, state replicated (the baseline);
- ``bf16 + f32 masters, ZeRO-1``: bfloat16 params,
  ``treeopt.Optimizer(tx, master_dtype=jnp.float32)``, masters and moments
  split over the data axis (``shard_state_over="data"``);
- ``float32, ZeRO-1``: the same optimizer on float32 params (which get no
  master copies), moments split over the data axis;
- ``bf16, no masters, ZeRO-1``: bfloat16 params and bfloat16 moments, the
  way raw optax, ``nnx.Optimizer`` or ``TrainState`` train them.

Every variant computes the forward and backward pass in float32 (bfloat16
params are cast up where they are used, so their gradients come back in
bfloat16), and every device holds the whole gradient, as after data
parallelism's all-reduce (a sharding constraint: without it XLA would carry
ZeRO's split of the update back into the backward pass, and the ZeRO
variants would do less arithmetic than the baseline for a reason that is not
the optimizer's). The variants differ only in what the optimizer stores and
where.

Three figures per variant:

- **step time**, the median of every timed step after warm-up (variants
  interleaved as in the other cases); CPU-only and indicative, since the 8
  virtual devices share the host's cores, each computing the whole
  replicated batch and, without ZeRO, the whole update;
- **params + optimizer state bytes on device 0**, summed over the arrays'
  addressable shards, as bytes per param beside the arithmetic for adam:
  ``2 + 12/N`` (bfloat16 params, float32 masters and moments split N ways),
  ``4 + 8/N`` (float32 params, moments split), ``4 + 8 = 12`` (replicated),
  ``2 + 4/N`` (bfloat16 params and moments); the step counts add a few bytes;
- **the loss after fine-tuning** on a real task, next-token prediction of
  sequences that repeat a random motif: a smaller float32 model is
  pre-trained briefly at a high learning rate (raw optax adam, one device),
  rounded to bfloat16, and fine-tuned from there by every variant's own
  step (the one timed, on the mesh) at a fine-tuning learning rate; the loss
  is measured in float32 on held-out sequences. ``moved`` is the fraction of param elements the fine-tuning
  changed: bfloat16 without masters rounds most updates away.

Runs in a fresh process with ``--xla_force_host_platform_device_count=8`` (the
suite's own process may have one device). Run alone:
``python -m benchmarks.mixed_precision [smoke|quick|full]``.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from benchmarks._common import Profile, Row, run_child

CASE = "mixed_precision"
DEVICES = 8
BASELINE = "optax"
HELD_OUT = 256  # sequences the fine-tuned models' loss is measured on
# --smoke checks that the case runs, not its speed: XLA's CPU backend optimizes less, compiling faster.
SMOKE_XLA_FLAGS = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true")
# variant: (param dtype, master_dtype, state split over the data axis); raw optax has no master_dtype.
VARIANTS: dict[str, tuple[str, str | None, bool]] = {
    BASELINE: ("float32", None, False),
    "bf16 + f32 masters, ZeRO-1": ("bfloat16", "float32", True),
    "float32, ZeRO-1": ("float32", "float32", True),
    "bf16, no masters, ZeRO-1": ("bfloat16", None, True),
}


@dataclass(frozen=True)
class Model:
    """A decoder-only transformer's sizes and the batch it is stepped on."""

    vocab: int
    d_model: int
    n_layers: int
    d_ff: int
    seq_len: int
    batch: int
    heads: int = 4

    def label(self) -> str:
        return f"{self.n_layers} x {self.d_model}, vocab {self.vocab}, {self.batch} x {self.seq_len} tokens"


@dataclass(frozen=True)
class Config:
    """One profile's sizes: the timed model, and the fine-tuning run."""

    timed: Model
    warmup: int
    rounds: int
    per_round: int
    trained: Model
    period: int  # the repeated motif's length
    pretrain_steps: int
    pretrain_lr: float
    finetune_steps: int
    finetune_lr: float


CONFIGS = {
    "full": Config(
        timed=Model(vocab=1024, d_model=256, n_layers=4, d_ff=1024, seq_len=64, batch=2),
        warmup=2,
        rounds=8,
        per_round=3,
        trained=Model(vocab=32, d_model=64, n_layers=2, d_ff=256, seq_len=32, batch=16),
        period=8,
        pretrain_steps=20,
        pretrain_lr=3e-3,
        finetune_steps=200,
        finetune_lr=1e-5,
    ),
    "quick": Config(
        timed=Model(vocab=256, d_model=128, n_layers=2, d_ff=512, seq_len=64, batch=2),
        warmup=2,
        rounds=3,
        per_round=3,
        trained=Model(vocab=32, d_model=64, n_layers=2, d_ff=256, seq_len=32, batch=16),
        period=8,
        pretrain_steps=20,
        pretrain_lr=3e-3,
        finetune_steps=100,
        finetune_lr=1e-5,
    ),
    "smoke": Config(
        timed=Model(vocab=16, d_model=16, n_layers=1, d_ff=32, seq_len=8, batch=2, heads=2),
        warmup=1,
        rounds=1,
        per_round=2,
        trained=Model(vocab=16, d_model=16, n_layers=1, d_ff=32, seq_len=8, batch=2, heads=2),
        period=4,
        pretrain_steps=0,  # smoke: straight from the random init (one compile fewer)
        pretrain_lr=3e-3,
        finetune_steps=2,
        finetune_lr=1e-5,
    ),
}


def arithmetic_bytes_per_param(variant: str, n: int = DEVICES) -> float:
    """Megatron-style bytes per param for adam: params, plus masters and two moments split ``n`` ways."""
    param_dtype, master_dtype, zero = VARIANTS[variant]
    param = 2 if param_dtype == "bfloat16" else 4
    masters = master_dtype is not None and param_dtype != master_dtype
    state = 4 + 8 if masters else 2 * param  # float32 masters and moments, or moments like the params
    return param + state / (n if zero else 1)


def transformer_params(model: Model, seed: int = 0) -> dict[str, Any]:
    """float32 params as host arrays: embeddings, ``n_layers`` pre-norm blocks, final norm, output head."""
    import numpy as np

    rng = np.random.default_rng(seed)
    d, f = model.d_model, model.d_ff

    def dense(n_in: int, n_out: int) -> Any:
        return rng.standard_normal((n_in, n_out), np.float32) / np.float32(np.sqrt(n_in))

    def norm() -> dict[str, Any]:
        return {"scale": np.ones((d,), np.float32), "bias": np.zeros((d,), np.float32)}

    def block() -> dict[str, Any]:
        return {
            "attention_norm": norm(),
            "attention": {name: dense(d, d) for name in ("query", "key", "value", "out")},
            "mlp_norm": norm(),
            "mlp": {
                "wi": dense(d, f),
                "bi": np.zeros((f,), np.float32),
                "wo": dense(f, d),
                "bo": np.zeros((d,), np.float32),
            },
        }

    return {
        "embedding": rng.standard_normal((model.vocab, d), np.float32) * np.float32(0.02),
        "position": rng.standard_normal((model.seq_len, d), np.float32) * np.float32(0.02),
        "layers": [block() for _ in range(model.n_layers)],
        "final_norm": norm(),
        "head": dense(d, model.vocab),
    }


def transformer_loss(model: Model, period: int) -> Callable[[Any, Any], Any]:
    """``loss(params, tokens)``: mean next-token cross-entropy after the first motif, in float32."""
    import jax
    import jax.numpy as jnp
    import optax

    def layer_norm(x: Any, p: dict[str, Any]) -> Any:
        mean = x.mean(-1, keepdims=True)
        var = jnp.square(x - mean).mean(-1, keepdims=True)
        return (x - mean) * jax.lax.rsqrt(var + 1e-6) * p["scale"] + p["bias"]

    def loss(params: Any, tokens: Any) -> Any:
        p = jax.tree.map(lambda x: x.astype(jnp.float32), params)  # float32 compute for every variant
        b, n = tokens.shape
        d, h = model.d_model, model.heads
        x = p["embedding"][tokens] + p["position"][:n]
        causal = jnp.tril(jnp.ones((n, n), bool))
        for layer in p["layers"]:
            a = layer["attention"]
            y = layer_norm(x, layer["attention_norm"])
            q, k, v = ((y @ a[name]).reshape(b, n, h, d // h) for name in ("query", "key", "value"))
            scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(d // h)
            weights = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
            x = x + jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, n, d) @ a["out"]
            m = layer["mlp"]
            y = layer_norm(x, layer["mlp_norm"])
            x = x + jax.nn.gelu(y @ m["wi"] + m["bi"]) @ m["wo"] + m["bo"]
        logits = layer_norm(x, p["final_norm"]) @ p["head"]
        ce = optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:])
        return ce[:, period - 1 :].mean()  # the tokens of the first motif are random: not predictable

    return loss


def motif_batches(model: Model, period: int, count: int, seed: int, rows: int | None = None) -> Any:
    """``count`` batches of ``rows`` sequences (the model's batch), each a random motif repeated."""
    import numpy as np

    rng = np.random.default_rng(seed)
    motifs = rng.integers(0, model.vocab, (count, rows or model.batch, period), dtype=np.int32)
    return np.tile(motifs, (1, 1, -(-model.seq_len // period)))[..., : model.seq_len]


def _child(profile_name: str) -> dict[str, Any]:
    """Runs in the fresh 8-device process: every variant's step timed, its bytes counted, its fine-tuning."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import treeopt
    from benchmarks._common import Stepper, interleaved, median_ms, spread
    from treeopt.partitioning import init_sharded, optimizer_shardings

    config = CONFIGS[profile_name]
    t0 = time.perf_counter()

    def log(message: str) -> None:  # progress, to stderr: the parent reads the figures from stdout
        print(f"[{CASE}] {time.perf_counter() - t0:6.1f} s  {message}", file=sys.stderr, flush=True)

    assert jax.device_count() >= DEVICES, jax.devices()
    mesh = Mesh(np.array(jax.devices()[:DEVICES]), ("data",))
    replicated = NamedSharding(mesh, P())
    device = jax.devices()[0]
    programs: dict[tuple[str, Model], tuple[Callable[..., Any], Callable[..., Any]]] = {}

    def device0_bytes(tree: Any) -> int:
        leaves = jax.tree.leaves(tree)
        return sum(s.data.nbytes for x in leaves for s in x.addressable_shards if s.device == device)

    def whole(loss_and_grads: Any) -> Any:
        """The gradients whole on every device, as after data parallelism's all-reduce.

        Without this, XLA's sharding propagation would carry ZeRO's split of the update back
        into the backward pass (each device computing a slice of the weight gradients, with
        the batch replicated), so the ZeRO variants would do several times less arithmetic
        than the baseline for a reason that is not the optimizer's.
        """
        return jax.lax.with_sharding_constraint(loss_and_grads, replicated)

    def program(variant: str, model: Model) -> tuple[Callable[..., Any], Callable[..., Any]]:
        """``(init, step)`` of a variant, built once per model: ``init(params32)`` puts its state on the mesh.

        ``step(state, tokens)`` returns ``(state, loss)``, jitted with the state donated.
        """
        if (variant, model) in programs:
            return programs[variant, model]
        param_dtype, master_dtype, zero = VARIANTS[variant]
        dtype = jnp.dtype(param_dtype)
        like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, dtype), transformer_params(model))
        loss_fn = transformer_loss(model, config.period)
        tx = optax.adamw(config.finetune_lr, weight_decay=0.01)

        def place(params32: Any) -> Any:  # from host arrays: fresh buffers, which the step may take
            return jax.device_put(jax.tree.map(lambda x: np.asarray(x).astype(dtype), params32), replicated)

        if variant == BASELINE:

            def init(params32: Any) -> Any:
                params = place(params32)
                return params, jax.jit(tx.init, out_shardings=replicated)(params)

            def step(state: Any, tokens: Any) -> Any:
                params, opt_state = state
                loss, grads = whole(jax.value_and_grad(loss_fn)(params, tokens))
                updates, opt_state = tx.update(grads, opt_state, params)
                return (optax.apply_updates(params, updates), opt_state), loss

            shardings: Any = replicated
        else:
            specs = jax.tree.map(lambda _: P(), like)
            over = "data" if zero else None
            # master_dtype no wider than every param is an error: float32 params get none
            opt = treeopt.Optimizer(tx, master_dtype=master_dtype if param_dtype != master_dtype else None)

            def init(params32: Any) -> Any:
                params = place(params32)
                return params, init_sharded(opt, params, mesh, specs, shard_state_over=over)

            def step(state: Any, tokens: Any) -> Any:
                params, opt = state
                loss, grads = whole(jax.value_and_grad(loss_fn)(params, tokens))
                return (opt.update(grads, params), opt), loss

            opt_shardings = optimizer_shardings(
                jax.eval_shape(opt.init, like), specs, mesh, shard_state_over=over
            )
            shardings = (jax.tree.map(lambda _: replicated, like), opt_shardings)
        jitted = jax.jit(
            step,
            in_shardings=(shardings, replicated),
            out_shardings=(shardings, replicated),
            donate_argnums=(0,),
        )
        programs[variant, model] = init, jitted
        return init, jitted

    results: dict[str, dict[str, Any]] = {v: {} for v in VARIANTS}

    # 1. Step time and bytes on the timed model.
    timed = config.timed
    params32 = transformer_params(timed)
    n_params = sum(int(x.size) for x in jax.tree.leaves(params32))
    tokens = jax.device_put(motif_batches(timed, config.period, 1, seed=1)[0], replicated)
    steppers = []
    for variant in VARIANTS:
        init, step = program(variant, timed)
        state = init(params32)
        params, rest = state
        figures = results[variant]
        figures["n_params"] = n_params
        figures["params_bytes_device0"] = device0_bytes(params)
        figures["state_bytes_device0"] = device0_bytes(rest)
        if variant != BASELINE:
            figures["master_bytes_device0"] = device0_bytes(rest.master)
        total = figures["params_bytes_device0"] + figures["state_bytes_device0"]
        figures["bytes_device0"] = total
        figures["mib_device0"] = total / 2**20
        figures["bytes_per_param"] = total / n_params
        figures["arithmetic_bytes_per_param"] = arithmetic_bytes_per_param(variant)
        cell = [state]

        def one(cell: list[Any] = cell, step: Callable[..., Any] = step) -> Any:
            cell[0], loss = step(cell[0], tokens)
            return loss

        stepper = Stepper(variant, one)
        jax.block_until_ready(stepper.step())  # compile
        log(f"compiled {variant}")
        steppers.append(stepper)
    interleaved(steppers, config.warmup, config.rounds, config.per_round)
    log("timed")
    for stepper in steppers:
        results[stepper.name].update(median_ms=median_ms(stepper.times), **spread(stepper.times))
    del steppers, state, params, rest

    # 2. Fine-tuning on the motif task, from a briefly pre-trained float32 model rounded to bfloat16.
    trained = config.trained
    loss_fn = transformer_loss(trained, config.period)
    pre_tx = optax.adam(config.pretrain_lr)

    @jax.jit
    def pretrain_step(params: Any, state: Any, tokens: Any) -> Any:
        grads = jax.grad(loss_fn)(params, tokens)
        updates, state = pre_tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    params = transformer_params(trained, seed=2)
    pre_state = pre_tx.init(params)
    for batch in motif_batches(trained, config.period, config.pretrain_steps, seed=3):
        params, pre_state = pretrain_step(params, pre_state, batch)
    log(f"pre-trained {config.pretrain_steps} steps")
    bf16 = jnp.dtype("bfloat16")
    start = jax.tree.map(lambda x: np.asarray(x).astype(bf16).astype(np.float32), params)  # bf16-exact
    held_out = motif_batches(trained, config.period, 1, seed=4, rows=HELD_OUT)[0]
    eval_loss = jax.jit(lambda params: loss_fn(params, held_out))  # on device 0, float32 params
    loss_start = float(eval_loss(start))
    batches = [
        jax.device_put(batch, replicated)
        for batch in motif_batches(trained, config.period, config.finetune_steps, seed=5)
    ]
    for variant in VARIANTS:
        init, step = program(variant, trained)
        state = init(start)
        before = [np.asarray(x) for x in jax.tree.leaves(state[0])]
        for batch in batches:
            state, loss = step(state, batch)
            # One step in flight at a time: a deep queue of 8-device programs on a busy CPU can leave
            # a collective waiting for threads past XLA's timeout, which aborts the process.
            jax.block_until_ready(loss)
        after = [np.asarray(x) for x in jax.tree.leaves(state[0])]
        changed = sum(int(np.sum(a != b)) for a, b in zip(after, before, strict=True))
        final = jax.tree.unflatten(jax.tree.structure(state[0]), [a.astype(np.float32) for a in after])
        results[variant].update(
            loss_start=loss_start,
            final_loss=float(eval_loss(final)),
            moved=changed / sum(b.size for b in before),
            trained_params=sum(b.size for b in before),
        )
        log(f"fine-tuned {variant}")
        results[variant]["loss"] = (
            f"{results[variant]['loss_start']:.4f} -> {results[variant]['final_loss']:.4f}"
        )
    return {"config": _config_dict(config), "variants": results}


def _config_dict(config: Config) -> dict[str, Any]:
    from dataclasses import asdict

    return asdict(config)


def measure(profile_name: str, timeout_s: float = 3600) -> dict[str, Any]:
    """The whole case in a fresh Python process with 8 virtual CPU devices; ``error`` if it failed."""
    flags = SMOKE_XLA_FLAGS if profile_name == "smoke" else ()
    return run_child(
        "benchmarks.mixed_precision", [profile_name], devices=DEVICES, xla_flags=flags, timeout_s=timeout_s
    )


def run(profile: Profile, log: Callable[[str], None] = print) -> list[Row]:
    config = CONFIGS[profile.name]
    # Two models: the step is timed on one, the losses come from fine-tuning the other.
    label = (
        f"adamw {config.finetune_lr:g}, timed on transformer {config.timed.label()}; "
        f"losses of transformer {config.trained.label()}, fine-tuned {config.finetune_steps} steps"
    )
    log(f"[{CASE}] {label}: {len(VARIANTS)} variants on {DEVICES} devices, own process")
    measured = measure(profile.name)
    rows = []
    reference = measured.get("variants", {}).get("float32, ZeRO-1", {}).get("median_ms")
    for variant in VARIANTS:
        figures = measured["variants"][variant] if "variants" in measured else {"error": measured["error"]}
        value = figures.get("median_ms")
        extra = dict(figures)
        if value is not None and reference and variant not in (BASELINE, "float32, ZeRO-1"):
            extra["vs_float32_zero"] = value / reference  # the masters' cost, ZeRO-1 on both sides
        rows.append(Row(CASE, label, variant, value, "ms", extra=extra))
    return rows


def main(argv: Sequence[str]) -> None:
    if argv and argv[0] == "--child":
        print(json.dumps(_child(argv[1])))
        return
    from benchmarks._common import FULL, QUICK, SMOKE, with_ratios
    from benchmarks._table import table

    profile = {"full": FULL, "quick": QUICK, "smoke": SMOKE}[argv[0] if argv else "full"]
    print(table(with_ratios(run(profile, log=lambda m: print(m, file=sys.stderr)))))


if __name__ == "__main__":
    main(sys.argv[1:])
