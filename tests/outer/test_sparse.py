"""The topk codec and error feedback on plain CPU tensors: sizes, selection, values, the EF identity."""

from __future__ import annotations

import pytest
import torch

from diloco.outer import sparse as sparse_module
from diloco.outer.codecs import Sparse, launch_reduce
from diloco.outer.overlap_plan import choose_overlap
from diloco.outer.perf_model import Link, SyncPlan, bandwidth_for, topk_bits_per_param, utilization, window_seconds
from diloco.outer.sparse import VALUE_BITS, TopK, feedback, outgoing, reduce_sparse
from tests.outer.test_auto_overlap import MirrorLane


@pytest.mark.parametrize("bits", VALUE_BITS)
@pytest.mark.parametrize(("numel", "density"), [(1, 0.5), (100, 0.02), (4096, 0.01), (10_000, 0.03), (9000, 1.0)])
def test_the_payload_has_its_stated_size_and_keeps_k_per_chunk(numel, density, bits):
    codec, exact = TopK(density, bits), TopK(density, 32)
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    payload = codec.encode(x)
    assert payload.dtype == torch.uint8 and payload.numel() == codec.nbytes(numel)
    decoded, selected = codec.decode(payload, numel), exact.decode(exact.encode(x), numel)
    width = codec.width(numel)
    for start in range(0, numel, width):
        chunk, kept = x[start : start + width], selected[start : start + width] != 0
        assert int(kept.sum()) == min(codec.kept(numel), chunk.numel())
        # the kept entries are the chunk's largest magnitudes; the rounded values keep their signs
        assert chunk.abs()[kept].min() >= torch.cat([chunk.abs()[~kept], torch.zeros(1)]).max()
        values = decoded[start : start + width]
        assert not values[~kept].any()
        assert torch.all(values[kept] * chunk[kept] >= 0)


def test_32_bit_values_are_sent_exactly_and_density_1_is_the_identity():
    x = torch.randn(10_000)
    assert torch.equal(TopK(1.0, 32).decode(TopK(1.0, 32).encode(x), x.numel()), x)
    codec = TopK(0.01, 32)
    decoded = codec.decode(codec.encode(x), x.numel())
    assert torch.equal(decoded[decoded != 0], x[decoded != 0])


def test_two_bit_values_are_the_chunks_smallest_or_largest_kept_magnitude():
    """b = 2: a sign and one of L = 2 levels, lo and hi, the nearest one."""
    x = torch.tensor([0.0, 1.0, -2.0, 2.9, -4.0, 0.1, 0.2, 0.3])
    codec = TopK(0.5, 2, chunk=8)  # k = 4 of 8: 1, -2, 2.9, -4; lo 1, hi 4, midpoint 2.5
    assert torch.equal(codec.decode(codec.encode(x), 8), torch.tensor([0.0, 1.0, -1.0, 4.0, -4.0, 0.0, 0.0, 0.0]))


def test_one_bit_values_are_the_sign_times_the_mean_kept_magnitude():
    x = torch.tensor([3.0, -1.0, 0.5, 2.0])
    codec = TopK(0.5, 1, chunk=4)
    assert torch.equal(codec.decode(codec.encode(x), 4), torch.tensor([2.5, -0.0, 0.0, 2.5]))


@pytest.mark.parametrize("bits", VALUE_BITS)
def test_more_bits_round_the_kept_values_closer(bits):
    x = torch.randn(8192, generator=torch.Generator().manual_seed(1))
    codec, exact = TopK(0.05, bits), TopK(0.05, 32)
    kept = exact.decode(exact.encode(x), x.numel())
    error = (codec.decode(codec.encode(x), x.numel()) - kept).norm() / kept.norm()
    assert error <= {1: 0.5, 2: 0.3, 4: 0.05, 8: 0.004, 32: 0.0}[bits]


@pytest.mark.parametrize("bits", [2, 32])
@pytest.mark.parametrize("decay", [1.0, 0.5, 0.0])
def test_error_feedback_identity_sent_plus_new_error_is_input_plus_decayed_error(bits, decay):
    """ŝ + e_new == Δ + β·e_prev, exactly: small integers (and β a power of two) keep every sum exact."""
    g = torch.Generator().manual_seed(bits)
    delta = torch.randint(-64, 64, (5000,), generator=g).float()
    error = torch.randint(-8, 8, (5000,), generator=g).float()
    codec, accumulated = TopK(0.03, bits), delta + decay * error
    payload, new_error = feedback(codec, delta, error, decay)
    assert new_error.data_ptr() == delta.data_ptr(), "e is written over Δ: nothing of the model's size is made"
    sent = codec.decode(payload, delta.numel())  # ŝ, what every peer decodes
    assert torch.equal(sent + new_error, accumulated)
    assert int((sent != 0).sum()) <= codec.chunks(5000) * codec.kept(5000)


def test_error_feedback_delivers_what_was_dropped_in_later_rounds():
    """Top-1 of 4 with Δ constant: every entry is sent in turn, and the total sent tracks the total Δ."""
    codec, delta = TopK(0.25, 32, chunk=4), torch.tensor([4.0, 3.0, 2.0, 1.0])
    error, total = torch.zeros(4), torch.zeros(4)
    for _ in range(20):
        payload, error = feedback(codec, delta.clone(), error, 1.0)
        total += codec.decode(payload, 4)
    assert torch.all(total > 0)
    torch.testing.assert_close(total + error, 20 * delta)


def test_a_zero_weight_payload_adds_nothing_and_weights_scale_each_group():
    codec = TopK(0.1, 32)
    a, b = torch.randn(1000), torch.randn(1000)
    payloads = [codec.encode(a), codec.encode(b), torch.zeros(codec.nbytes(1000), dtype=torch.uint8)]
    summed = reduce_sparse(payloads, [1.0, 3.0, 0.0], codec, 1000)
    expected = codec.decode(payloads[0], 1000) + 3.0 * codec.decode(payloads[1], 1000)
    assert torch.equal(summed, expected)


def test_a_kept_entry_is_averaged_over_its_senders_but_over_no_fewer_than_n_groups():
    """M = 4, N = 2: an entry one group sent is ŝ/2 (not ŝ/4), one three sent their sum/3, one all four
    sent the plain mean; a zero value is not sent (density 1 and 32 bits keep them as they are). M <= N,
    and nonzero payloads at density 1 at any M, are the plain mean bit for bit."""
    codec = TopK(1.0, 32)
    by_group = torch.tensor([[8.0, 3.0, 1.0, 0.0], [0.0, 6.0, 2.0, 0.0], [0.0, 9.0, 3.0, 0.0], [0.0, 0.0, 6.0, 0.0]])
    payloads = [codec.encode(row) for row in by_group]
    averaged = torch.tensor([4.0, 6.0, 3.0, 0.0])
    torch.testing.assert_close(reduce_sparse(payloads, [1.0] * 4, codec, 4, reference_groups=2) / 4, averaged)
    blank = torch.zeros(codec.nbytes(4), dtype=torch.uint8)  # a healing group: not one of the M
    summed = reduce_sparse([*payloads, blank], [2.0] * 4 + [0.0], codec, 4, reference_groups=2)
    torch.testing.assert_close(summed / 8, averaged)
    plain = reduce_sparse(payloads, [1.0] * 4, codec, 4)
    assert torch.equal(plain, by_group.sum(dim=0))
    for n in (4, 5):  # M <= N: the plain mean, bit for bit
        assert torch.equal(reduce_sparse(payloads, [1.0] * 4, codec, 4, reference_groups=n), plain)
    dense = [codec.encode(torch.randn(1000)) for _ in range(4)]  # density 1: every group sent every entry
    weights = [1.0, 3.0, 2.0, 2.0]
    assert torch.equal(
        reduce_sparse(dense, weights, codec, 1000, reference_groups=2), reduce_sparse(dense, weights, codec, 1000)
    )


def test_the_sparse_reduce_sends_the_planned_bytes_and_averages_over_contributors():
    codec = TopK(0.02, 2)
    delta, extras = torch.randn(20_000), torch.tensor([1.0, 0.5, 2.0])
    payload = codec.encode(delta)
    sparse = Sparse(codec, decay=0.0)
    given = delta.clone()  # the round's own: e is written over it
    pending = launch_reduce(MirrorLane(3), given, 2.0, sparse, 3, error=torch.zeros(20_000), extras=extras)
    assert pending.bytes_sent == sparse.bytes_sent(delta.numel(), 3, n_extras=3)
    assert pending.bytes_sent == 2 * (payload.numel() + 16)
    average = pending.result(lambda work: None)
    torch.testing.assert_close(average, codec.decode(payload, delta.numel()))  # three equal groups: their mean
    torch.testing.assert_close(pending.extras, 3 * extras)
    torch.testing.assert_close(pending.error + codec.decode(payload, delta.numel()), delta)  # e = Δ − ŝ


def test_bad_codec_settings_are_refused():
    for density in (0.0, 1.5, -0.1):
        with pytest.raises(ValueError, match="density"):
            TopK(density)
    with pytest.raises(ValueError, match="value_bits"):
        TopK(0.1, 3)
    with pytest.raises(ValueError, match="bytes"):
        TopK(0.1).decode(torch.zeros(3, dtype=torch.uint8), 1000)


def test_the_perf_model_sizes_a_gathered_topk_payload():
    codec, params = TopK(0.02, 2), 800_000
    bits = topk_bits_per_param(codec, params)
    assert bits == 8 * codec.nbytes(params) / params and bits < 0.32  # 2% of 32 bits, then some
    link, groups = Link(1e6), 4
    plan = SyncPlan(sync_every=50, bits_per_param=bits, gathered=True)
    transfer = (groups - 1) * params * bits / 1e6  # each group sends its payload to three peers
    assert window_seconds(plan, params, 0.1, groups, link) == pytest.approx(50 * 0.1 + transfer)
    assert utilization(plan, params, 0.1, groups, Link(bandwidth_for(0.9, plan, params, 0.1, groups))) == (
        pytest.approx(0.9)
    )


def test_auto_overlap_with_topk_picks_tau_for_the_sparse_payload_and_keeps_the_format():
    codec = Sparse(TopK(0.02, 2), decay=0.95)
    plan = choose_overlap(
        fragment_numel=800_000, groups=2, window_steps=25, step_s=0.1, seconds_per_byte=1e-5, sparse=codec
    )
    assert (plan.delay, plan.quantize) == (3, "none")  # 30 kB at 100 kB/s: 0.3 s, hidden by three 0.1 s steps
    assert plan.transfer_s == pytest.approx(codec.bytes_sent(800_000, 2) * 1e-5)


def test_a_group_that_does_not_contribute_sends_a_blank_payload_of_the_same_size_and_keeps_its_error():
    codec, delta, error = TopK(0.05, 2), torch.randn(3000), torch.randn(3000)
    blank, kept = outgoing(codec, delta, error, 0.95, 0.0, torch.device("cpu"))
    assert kept is error and blank.numel() == codec.nbytes(3000) and not blank.any()
    accumulated = delta + 0.95 * error
    payload, new_error = outgoing(codec, delta, error, 0.95, 2.0, torch.device("cpu"))
    assert torch.equal(payload, codec.encode(accumulated)) and new_error.data_ptr() == delta.data_ptr()
    torch.testing.assert_close(codec.decode(payload, 3000) + new_error, accumulated)


@pytest.mark.parametrize("bits", [1, 2, 32])
def test_a_step_of_rows_at_a_time_gives_the_bits_of_one_step_over_everything(bits, monkeypatch):
    """encode, decode, feedback and reduce_sparse go 8 chunks at a time (the fewest a step takes,
    so every step's codes start on a byte): the same payload, e and sum as one step over all."""
    codec, numel = TopK(density=0.05, value_bits=bits, chunk=64), 64 * 37 + 5  # 38 chunks, the last partial
    g = torch.Generator().manual_seed(3)
    delta, error = torch.randn(numel, generator=g), torch.randn(numel, generator=g)
    monkeypatch.setattr(sparse_module, "STEP_VALUES", 1 << 30)
    assert len(codec.steps(numel)) == 1
    whole = feedback(codec, delta.clone(), error, 0.9)
    summed = reduce_sparse([whole[0], codec.encode(error)], [1.0, 2.0], codec, numel, reference_groups=1)
    monkeypatch.setattr(sparse_module, "STEP_VALUES", 1)
    assert len(codec.steps(numel)) == 5
    stepped = feedback(codec, delta.clone(), error, 0.9)
    assert all(torch.equal(a, b) for a, b in zip(stepped, whole))
    assert torch.equal(codec.encode(delta + 0.9 * error), whole[0])
    assert torch.equal(codec.decode(whole[0], numel) + whole[1], delta + 0.9 * error), "ŝ + e is a"
    again = reduce_sparse([stepped[0], codec.encode(error)], [1.0, 2.0], codec, numel, reference_groups=1)
    assert torch.equal(again.view(torch.int32), summed.view(torch.int32))
