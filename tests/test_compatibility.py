"""One table of what does not run with what (engine/compatibility.py), checked as the config is built."""

from pathlib import Path

import pytest

from pagoda.engine import compatibility
from pagoda.engine.config import EngineConfig

DRAFT = {"method": "draft_model", "model": "/nowhere", "num_speculative_tokens": 2}


@pytest.mark.parametrize("settings, message", [
    (dict(speculative_config=DRAFT, tensor_parallel_size=2),
     "--speculative-config with a draft model does not run with --tensor-parallel-size above 1 yet: use the 'ngram'"),
    (dict(quantization="int8", tensor_parallel_size=2),
     "--quantization int8 does not run with --tensor-parallel-size above 1 yet: pass --quantization none"),
    (dict(batch_invariant=True, attention_backend="torch_sdpa"),
     "--batch-invariant does not run with an --attention-backend other than cpu_paged yet: leave"),
])
def test_a_refused_pair_fails_as_the_config_is_built_naming_both_and_the_way_out(settings, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        EngineConfig(**settings)
    # Each setting alone is fine, and so is the way out.
    for name, value in settings.items():
        EngineConfig(**{name: value})
    EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 2}, tensor_parallel_size=2)
    EngineConfig(batch_invariant=True, attention_backend="cpu_paged")


def test_the_server_refuses_it_before_loading_anything(capsys):
    from pagoda.cli.main import main

    assert main(["serve", "--quantization", "int8", "--tensor-parallel-size", "2", "--port", "0"]) != 0
    assert "--quantization int8 does not run with --tensor-parallel-size above 1" in capsys.readouterr().err


def test_the_docs_table_is_the_code_table():
    engine_md = (Path(__file__).parent.parent / "docs" / "engine.md").read_text()
    assert compatibility.markdown_table() in engine_md
    assert len(compatibility.INCOMPATIBILITIES) >= 5
