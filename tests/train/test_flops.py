"""Model FLOPs per token against a hand count, the devices' peaks, and MFU."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from diloco.config.model import ModelConfig
from diloco.train import flops
from diloco.train.flops import (
    Peak,
    Utilization,
    cores_per_worker,
    device_peak,
    flops_per_token,
    handed_peak,
    known_peak_tflops,
    launcher_cpu_peak,
    measured_peak,
    non_embedding_parameters,
)
from diloco.train.model import count_parameters, meta_model

# dim 8, 2 layers, 2 query heads and 1 KV head of width 4, SwiGLU width 24, vocabulary 16.
SMALL = ModelConfig(dim=8, n_layers=2, n_heads=2, n_kv_heads=1, vocab_size=16, ffn_hidden_dim=24)


def test_flops_per_token_is_6n_plus_palms_attention_term_by_hand():
    # wq 8·8 + wk 8·4 + wv 8·4 + wo 8·8 = 192; w1, w3, w2 3·8·24 = 576; two norms 16: 784 a block.
    # N = 2·784 + final norm 8 + output head 16·8 = 1704 (the embedding table does no matmul).
    assert non_embedding_parameters(SMALL) == 1704
    # 12·L·H·Q·T = 12·2·2·4·10 = 1920 at T = 10.
    assert flops_per_token(SMALL, seq_len=10) == 6 * 1704 + 1920


@pytest.mark.parametrize("tied", [False, True])
def test_n_is_the_models_parameters_but_the_embedding_lookup(tied):
    cfg = dataclasses.replace(SMALL, tie_embeddings=tied)
    embedding = 0 if tied else cfg.vocab_size * cfg.dim  # tied, the shared matrix is the output head's
    assert non_embedding_parameters(cfg) == count_parameters(meta_model(cfg)) - embedding


@pytest.mark.parametrize(
    ("name", "tflops"),
    [
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H100 NVL", 835.0),
        ("NVIDIA H200", 989.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA A100 80GB PCIe", 312.0),
        ("NVIDIA L40S", 362.0),
        ("NVIDIA L4", 121.0),
        ("NVIDIA L40", None),
        ("Tesla T4", None),
    ],
)
def test_known_gpus_are_found_by_the_words_of_their_name(name, tflops):
    assert known_peak_tflops(name) == tflops


def test_the_peak_is_the_setting_else_measured_on_cpu_and_said_so():
    assert device_peak(123.0, torch.device("cpu")).source == "cluster.peak_tflops"
    peak = device_peak(0.0, torch.device("cpu"))
    assert peak.tflops > 0 and peak.source.startswith("measured: best torch.float32 512x512 matmul on cpu")
    assert measured_peak(torch.device("cpu")) is peak  # once per process


def test_a_peak_handed_over_by_the_launcher_is_used_unless_the_setting_says_otherwise():
    handed = Peak(0.05, "measured once by the launcher")
    assert handed_peak({"PATH": "/bin", **handed.to_environ()}) == handed
    assert handed_peak({"PATH": "/bin"}) is None  # under torchrun: the worker measures its own
    assert device_peak(0.0, torch.device("cpu"), handed) == handed
    assert device_peak(123.0, torch.device("cpu"), handed).source == "cluster.peak_tflops"


def test_workers_together_never_claim_more_than_all_the_cores():
    assert cores_per_worker(threads=1, workers=4, cores=2) == 0.5
    assert cores_per_worker(threads=1, workers=2, cores=2) == 1
    assert cores_per_worker(threads=2, workers=1, cores=2) == 2
    assert cores_per_worker(threads=2, workers=2, cores=5) == 2  # the fifth core is no worker's


def test_the_launchers_figure_says_how_it_was_measured_and_shared(monkeypatch):
    monkeypatch.setattr(flops, "one_core_tflops", lambda: 0.1)
    peak = launcher_cpu_peak.__wrapped__(threads=1, workers=4, cores=2)  # unmeasured: no cache
    assert peak.tflops == pytest.approx(0.05)
    assert peak.source == (
        "measured once by the launcher on the idle machine: best torch.float32 512x512 matmul on one core "
        "(0.1) x 0.5 cores per worker (4 x 1 thread on 2 cores)"
    )


def test_utilization_is_achieved_flops_over_the_groups_peak():
    # 1e9 FLOPs a token at 3,000 tokens/s on two devices of 1.5 TFLOP/s: 3 TFLOP/s of 3, MFU 1.
    metrics = Utilization(flops_per_token=10**9, peak_tflops=2 * 1.5).metrics(3000.0)
    assert metrics == pytest.approx({"train/tflops": 3.0, "train/mfu": 1.0})
