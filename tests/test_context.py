"""Context parallelism: the load-balanced order (MaxText's DUAL_CHUNK_SWAP), and each attention kernel with the
sequence split over `sequence` equal to the unsplit dot product, balanced or not."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from models_util import cpu_mesh

from maxperf.models import context
from maxperf.models.layers import attention_kernels as ak

TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}


def test_the_balanced_order_is_maxtexts_dual_chunk_swap():
    # MaxText's reorder_causal_load_balanced docstring: GPU0 [0, 1, 14, 15], GPU1 [4, 5, 10, 11], ...
    order = context.balanced_order(16, 4)
    assert order.tolist() == [0, 1, 14, 15, 2, 3, 12, 13, 4, 5, 10, 11, 6, 7, 8, 9]
    x = jnp.arange(2 * 16).reshape(2, 16)
    np.testing.assert_array_equal(context.restore(context.reorder(x, 4), 4), x)
    # every shard attends to as many keys under a causal mask
    per_shard = (order.reshape(4, 4) + 1).sum(axis=1)
    assert len(set(per_shard.tolist())) == 1
    with pytest.raises(ValueError, match="needs L a multiple of 8"):
        context.balanced_order(12, 4)


def _qkv(L=256, B=2, K=2, G=2, Dh=16):
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    return (0.3 * jax.random.normal(keys[0], (B, L, K, G, Dh)), jax.random.normal(keys[1], (B, L, K, Dh)),
            jax.random.normal(keys[2], (B, L, K, Dh)))


def _dot(q, k, v, window=0):
    return ak.dot_product(q, k, v, window, softcap=None, float32_qk_product=False, float32_logits=False)


def _split(kernel, q, k, v, balanced):
    """sum(sin(attention)) and its gradients, the sequence split in 2 over `sequence` (balanced: reordered first and
    put back after), batch over fsdp and heads over tensor."""
    mesh = cpu_mesh({"fsdp": 2, "sequence": 2, "tensor": 2})

    def f(q, k, v):
        if balanced:
            q, k, v = (context.reorder(x, 2) for x in (q, k, v))
        out = kernel(q, k, v, ((("sequence",), 2, balanced)))
        return jnp.sum(jnp.sin(context.restore(out, 2) if balanced else out))

    with jax.set_mesh(mesh):
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))(q, k, v)


def _assert_close(got, ref):
    np.testing.assert_allclose(got[0], ref[0], **TOLERANCE)
    for a, b in zip(got[1], ref[1]):
        np.testing.assert_allclose(a, b, **TOLERANCE)


@pytest.mark.parametrize("balanced", [True, False])
@pytest.mark.parametrize("window", [0, 100])
def test_the_blockwise_kernel_split_over_the_sequence_equals_the_dot_product(balanced, window):
    q, k, v = _qkv()
    ref = jax.value_and_grad(lambda q, k, v: jnp.sum(jnp.sin(_dot(q, k, v, window))), argnums=(0, 1, 2))(q, k, v)
    got = _split(lambda q, k, v, cp: ak.blockwise_context(q, k, v, window, None, None, cp), q, k, v, balanced)
    _assert_close(got, ref)


def test_the_dot_product_masks_a_balanced_sequence_by_its_original_places():
    q, k, v = _qkv()
    ref = jax.value_and_grad(lambda q, k, v: jnp.sum(jnp.sin(_dot(q, k, v))), argnums=(0, 1, 2))(q, k, v)
    got = _split(lambda q, k, v, cp: ak.dot_product(q, k, v, 0, softcap=None, float32_qk_product=False,
                                                    float32_logits=False, ids=context.query_ids(256, 2, True)),
                 q, k, v, True)
    _assert_close(got, ref)


@pytest.mark.slow
@pytest.mark.parametrize("balanced, window", [(True, 0), (False, 0), (True, 100)])
def test_splash_split_over_the_sequence_equals_the_dot_product(balanced, window):
    # interpret mode on CPU devices: the kernel's mask split by query shard and head shard, as on a TPU
    q, k, v = _qkv(L=512)
    ref = jax.value_and_grad(lambda q, k, v: jnp.sum(jnp.sin(_dot(q, k, v, window))), argnums=(0, 1, 2))(q, k, v)
    got = _split(lambda q, k, v, cp: ak.splash(q, k, v, window, softcap=None, blocks=(128,) * 8, interpret=True,
                                               cp=cp), q, k, v, balanced)
    _assert_close(got, ref)


@pytest.mark.slow
@pytest.mark.parametrize("balanced", [True, False])
def test_a_step_with_the_sequence_split_gives_the_unsplit_loss(balanced):
    """The train step over 4 CPU devices with the sequence split in 2 (MaxText's context parallelism, the batch
    reordered by its load balancing or not) takes the same two losses as with fsdp alone, from the same state."""
    import jax
    from models_util import tiny, two_step_losses

    from maxperf.models import train_step

    words = ("seq_len=16", f"context_parallel_load_balance={str(balanced).lower()}")
    _, flat = tiny(*words, "ici_fsdp=4", devices=4)
    _, split = tiny(*words, "ici_sequence=2", "ici_fsdp=2", devices=4)
    batch = jax.device_get(train_step.synthetic_batch(flat, seed=1))
    np.testing.assert_allclose(two_step_losses(split, batch), two_step_losses(flat, batch), rtol=2e-5)


def test_load_balancing_needs_whole_chunks_and_no_multi_token_prediction():
    from maxperf.spec import resolve
    from maxperf.spec.errors import MaxperfError

    with pytest.raises(MaxperfError, match="seq_len=24 must be a multiple of 16"):
        resolve("cpu-8", "tiny", ["seq_len=24", "ici_sequence=8"])
    assert resolve("cpu-8", "tiny", ["seq_len=24", "ici_sequence=8", "context_parallel_load_balance=false"])
    with pytest.raises(MaxperfError, match="multi-token prediction"):
        resolve("cpu-4", "tiny", ["ici_sequence=2", "mtp_num_layers=1"])


def test_without_load_balancing_the_step_waits_for_the_busiest_context_shard():
    """A causal layer's last of cp contiguous shards sees (2 cp - 1) / cp times the mean shard's pairs; with
    MaxText's load balancing every shard sees the mean. A window narrower than a shard leaves them near even, and
    the dot product, which computes every pair, is not unbalanced."""
    from maxperf.perfmodel import estimate
    from maxperf.perfmodel.flops import busiest_context_shard
    from maxperf.spec import presets
    from maxperf.spec.request import resolve

    assert busiest_context_shard(presets.get("llama3-8b"), 131072, 16) == pytest.approx((31 / 16,) * 32, rel=1e-4)
    gemma = presets.get("gemma3-4b")  # 1024-token windows in five layers of six
    windowed = busiest_context_shard(gemma, 32768, 8)
    globals_ = [f for f, w in zip(windowed, gemma.layer_windows()) if not w]
    assert globals_ and globals_ == pytest.approx([15 / 8] * len(globals_), rel=1e-3)
    assert all(1 <= f < 1.02 for f, w in zip(windowed, gemma.layer_windows()) if w)

    def attention_s(*words):
        est = estimate(resolve("v5p-128", "llama3-8b", ["seq_len=131072", "ici_sequence_parallelism=16", *words]))
        return next(r.seconds for r in est.breakdown if r.name.startswith("attention"))

    balanced, unbalanced = attention_s(), attention_s("context_parallel_load_balance=false")
    assert unbalanced == pytest.approx(balanced * 31 / 16, rel=1e-4)
    dot = "attention=dot_product", "remat_policy=full"
    assert attention_s(*dot, "context_parallel_load_balance=false") == pytest.approx(attention_s(*dot))


def test_the_memory_of_a_context_split_holds_the_gathered_keys_and_values():
    """At the same tokens a device, splitting a longer sequence over the context axis adds the other shards' keys
    and values (and their gradients) to the attention's working set: llama2-7b at 512k tokens over 16 needs about
    the 32 KiB a token of a layer's gathered k and v twice over, and no longer fits where 32k tokens whole did."""
    from maxperf.perfmodel import estimate_memory
    from maxperf.spec.request import resolve

    def total(*words):
        p = resolve("v5p-32", "llama2-7b", ["remat_policy=minimal", *words])
        return estimate_memory(p.model, p.train, p.mesh, 95 * 2**30, "tpu").per_device_total_bytes

    whole = total("per_device_batch_size=1", "seq_len=32768")
    split = total("per_device_batch_size=0.0625", "seq_len=524288", "ici_context_parallelism=16")
    per_token = 2 * 2 * 32 * (128 + 128) * 15  # k and v of the 15 other shards, and their gradients, in bfloat16
    assert split - whole == pytest.approx(32768 * per_token, rel=0.25)
    assert whole < 95 * 2**30 < split
