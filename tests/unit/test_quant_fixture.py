"""The test checkpoints are what llmcompressor writes.

``tiny_quant.quantize_compressed_tensors`` stands in for llmcompressor, which
cannot be installed beside vLLM 0.33 (``tests/fixtures/llmcompressor_reference.py``).
For each recorded preset (W8A8, W8A16, W4A16, data-free, the LM head left
unquantized) the fixture's checkpoint of the same tiny Llama must carry the
same ``quantization_config`` and the same tensors (names, dtypes, shapes),
and, where this host draws the same random base model as the host that made
the record, the same bytes.
"""

from __future__ import annotations

import json

import pytest

from tests.fixtures.llmcompressor_reference import (
    BASE_SHAPE,
    PRESETS,
    RECORD,
    describe,
    weights_digest,
)
from tests.fixtures.tiny_models import build_tiny_llama
from tests.fixtures.tiny_quant import quantize_compressed_tensors

RECORDED = json.loads(RECORD.read_text())


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    base = build_tiny_llama(tmp_path_factory.mktemp("lc_base"), **BASE_SHAPE)
    out = {"base": weights_digest(base)}
    for preset in PRESETS:
        dst = tmp_path_factory.mktemp(f"lc_{preset}")
        out[preset] = describe(quantize_compressed_tensors(base, dst, preset))
    return out


def test_record_covers_the_presets():
    assert sorted(RECORDED["presets"]) == sorted(PRESETS)
    assert RECORDED["llmcompressor"].startswith("0.14")


@pytest.mark.parametrize("preset", PRESETS)
def test_fixture_writes_llmcompressor_format(written, preset):
    mine, theirs = written[preset], RECORDED["presets"][preset]
    assert mine["quantization_config"] == theirs["quantization_config"]
    assert {n: v[:2] for n, v in mine["tensors"].items()} == {
        n: v[:2] for n, v in theirs["tensors"].items()
    }


@pytest.mark.parametrize("preset", PRESETS)
def test_fixture_writes_llmcompressor_values(written, preset):
    if written["base"] != RECORDED["base_weights_sha256"]:
        pytest.skip(
            "this host's torch draws another random tiny Llama than the one "
            "recorded, so only the format is compared"
        )
    mine, theirs = written[preset], RECORDED["presets"][preset]
    differ = [
        n for n in theirs["tensors"] if mine["tensors"][n] != theirs["tensors"][n]
    ]
    assert not differ, differ
