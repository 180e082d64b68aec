"""The lines a local job prints at its start, from its JobConfig alone."""

from __future__ import annotations

from pathlib import Path

from diloco.config.job import job_config_from_dict
from diloco.config.warmups import warmup_line
from diloco.huge_pages import huge_pages_line
from diloco.launch.header import header_lines, model_preset, payload_of

URL = "http://127.0.0.1:22747"
RUN = Path("/tmp/run")
TINY_PARAMS = 131_392


def header(raw: dict, n_params: int = TINY_PARAMS, status_url: str | None = URL) -> list[str]:
    return header_lines(job_config_from_dict(raw), n_params, status_url, RUN)


def test_the_default_job_in_five_lines():
    job = job_config_from_dict({})
    assert header({}) == [
        "model: tiny (2 layers, dim 64, 4 heads, vocab 256), 131,392 parameters; 2 groups x 2 workers (dp 2)",
        "algo: diloco H=50 P=1 τ=0, payload fp32, inner adamw lr 0.003, outer nesterov lr 0.7; 18 rounds of ~526 kB "
        "per group",
        "tokens: 2,048 per step per group (batch 8 x dp 2 x accum 1 x seq 128), 4,096 per step; 2,048,000 in 500 steps",
        warmup_line(job),
        f"watch: run directory {RUN}, status page {URL}/",
    ]


def test_the_status_page_ends_its_line_for_tools_that_read_it_and_a_job_without_a_lighthouse_has_none():
    assert header({})[-1].endswith(f"status page {URL}/")
    assert header({"algo": {"name": "local"}}, status_url=None)[-1] == f"watch: run directory {RUN}"


def test_a_preset_is_named_and_a_shape_of_ones_own_is_only_described():
    small = header({"model": {"dim": 384, "n_layers": 12, "n_heads": 6}}, n_params=19_101_312)[0]
    assert small.startswith("model: small (12 layers, dim 384, 6 heads, vocab 256), 19,101,312 parameters;")
    assert header({"model": {"n_layers": 3}})[0].startswith("model: 3 layers, dim 64, 4 heads, vocab 256, ")
    assert model_preset(job_config_from_dict({"model": {"dim": 128, "n_layers": 4}}).model) == "mini"


def test_the_mesh_names_pipeline_and_tensor_parallel_degrees_beside_dp():
    tp = header({"cluster": {"workers_per_group": 4}, "parallel": {"tp": 2}})[0]
    assert tp.endswith("2 groups x 4 workers (dp 2 x tp 2)")
    pp = header({"model": {"n_layers": 4}, "cluster": {"groups": 1, "workers_per_group": 2}, "parallel": {"pp": 2}})[0]
    assert pp.endswith("1 group x 2 workers (pp 2 x dp 1)")


def test_streaming_rounds_sync_one_fragment_of_a_quantized_payload():
    streaming = {"name": "streaming", "sync_every": 100, "fragments": 2, "delay": 1, "quantize": "fp4"}
    line = header({"algo": streaming | {"sync_warmup_steps": 0}})[1]
    # 5 windows x 2 fragments; fp4: half a byte per value plus a 4-byte scale per 128: 69.8 kB / 2
    assert line == (
        "algo: streaming H=100 P=2 τ=1, payload fp4, inner adamw lr 0.003, outer nesterov lr 0.7; 10 rounds of "
        "~34.9 kB per group"
    )
    muon = header({"inner_opt": {"name": "muon", "lr": 0.02}})[1]
    assert ", inner muon lr 0.02, outer nesterov lr 0.7;" in muon, "the inner optimizer is named"


def test_a_topk_payload_is_sized_by_its_codec():
    algo = job_config_from_dict({"algo": {"compress": "topk", "density": 0.01, "value_bits": 2}}).algo
    described, size = payload_of(algo, TINY_PARAMS)
    assert described == "top 1% in 2-bit values" and 2_000 < size < 3_000  # ~16 bits per kept value of 1%


def test_ddp_and_local_say_how_they_sync_instead_of_h_and_rounds():
    ddp = header({"algo": {"name": "ddp", "sync_every": 1}})
    assert ddp[1] == (
        "algo: ddp, the gradients all-reduced every step, inner adamw lr 0.003: 500 rounds of ~526 kB per group"
    )
    local = header({"algo": {"name": "local"}}, status_url=None)
    assert local[1] == (
        "algo: local, every group trains alone (no sync; the no-communication baseline), inner adamw lr 0.003"
    )
    assert len(ddp) == len(local) == 4  # neither has warm-ups


def test_huge_pages_are_said_when_on_with_the_kernel_granting_none_said_too_and_nothing_when_off(tmp_path):
    setting = tmp_path / "enabled"
    setting.write_text("always [madvise] never\n")
    on = huge_pages_line({"THP_MEM_ALLOC_ENABLE": "1"}, setting)
    assert on == (
        "memory: torch's CPU allocations of 2 MB or more ask for transparent huge pages (THP_MEM_ALLOC_ENABLE=1; =0 "
        "turns it off)"
    )
    setting.write_text("always madvise [never]\n")
    assert (
        huge_pages_line({"THP_MEM_ALLOC_ENABLE": "1"}, setting)
        == f"{on}, but the kernel grants none ({setting}: never)"
    )
    assert huge_pages_line({"THP_MEM_ALLOC_ENABLE": "1"}, tmp_path / "absent") == on
    assert huge_pages_line({"THP_MEM_ALLOC_ENABLE": "0"}, setting) is None and huge_pages_line({}, setting) is None
    lines = header_lines(job_config_from_dict({}), TINY_PARAMS, URL, RUN, on)
    assert lines[-2:] == [on, f"watch: run directory {RUN}, status page {URL}/"], "before the page, which ends it"
