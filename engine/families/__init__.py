"""Model families: each file describes one (see family.py); this module lists them.

Adding a family: write ``engine/families/<name>.py`` with its :class:`Family` objects, add the
module to ``_MODULES`` below, and copy a family's test in tests/test_families.py
(docs/model-families.md walks through it).
"""

from __future__ import annotations

from pagoda.engine.families import gemma, llama, mixtral, phi3, qwen3
from pagoda.engine.families.family import Family

_MODULES = (llama, qwen3, mixtral, phi3, gemma)

#: Every family, by Pagoda's architecture name.
FAMILIES: dict[str, Family] = {family.name: family for module in _MODULES for family in module.FAMILIES}
#: Hugging Face ``architectures`` entries -> family.
BY_ARCHITECTURE: dict[str, Family] = {arch: family for family in FAMILIES.values()
                                      for arch in family.architectures}
#: (llama.cpp's ``general.architecture``, whether the file has experts) -> family, for the GGUF
#: files Pagoda reads.
BY_GGUF_ARCHITECTURE: dict[tuple[str, bool], Family] = {(family.gguf_architecture, family.moe): family
                                                        for family in FAMILIES.values() if family.gguf_architecture}

__all__ = ["BY_ARCHITECTURE", "BY_GGUF_ARCHITECTURE", "FAMILIES", "Family"]
