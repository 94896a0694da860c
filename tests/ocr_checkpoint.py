"""An OCR-style checkpoint built from the V2 stand-in (fixtures/deepseek_v2), written from the facts of DeepSeek-OCR's
and DeepSeek-VL2's language models, never from their text: config.json's auto_map names a small wrapper module, which
imports the V2-form language model (`modeling_deepseekv2.py`) relatively; that model's router has V3's `noaux_tc`
branch (sigmoid scores, a correction bias for the choice, `assert not self.training`), and with `use_mla: false` its
decoder layers take transformers' Llama attention classes, imported beside the removed LlamaFlashAttention2.
"""

from __future__ import annotations

import json
from pathlib import Path

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
V2 = FIXTURES / "deepseek_v2"

LLAMA_IMPORT = (
    "from transformers.models.llama.modeling_llama import (\n    LlamaAttention,\n    LlamaFlashAttention2,\n)\n"
)
GATE_INIT = "        self.reset_parameters()\n"
BIAS = (
    '        if self.topk_method == "noaux_tc":\n'
    "            self.e_score_correction_bias = nn.Parameter(torch.zeros(self.n_routed_experts))\n"
)
SCORING_ELSE = '        else:\n            raise NotImplementedError(\n                f"unsupported scoring function'
SIGMOID = '        elif self.scoring_func == "sigmoid":\n            scores = logits.sigmoid()\n'
TOPK_ELSE = '        else:\n            raise NotImplementedError(\n                f"unsupported top-k method'
NOAUX_GUARD = "            assert not self.training\n"
NOAUX = (
    '        elif self.topk_method == "noaux_tc":\n' + NOAUX_GUARD + "            n_tokens = scores.shape[0]\n"
    "            biased = scores + self.e_score_correction_bias.unsqueeze(0)\n"
    "            grouped = biased.view(n_tokens, self.n_group, -1)\n"
    "            # a group is worth the sum of its two best experts\n"
    "            group_strength = grouped.topk(2, dim=-1)[0].sum(dim=-1)\n"
    "            best_groups = group_strength.topk(self.topk_group, dim=-1, sorted=False)[1]\n"
    "            keep_group = torch.zeros_like(group_strength, dtype=torch.bool)\n"
    "            keep_group.scatter_(1, best_groups, True)\n"
    "            keep_expert = keep_group.unsqueeze(-1).expand_as(grouped).reshape(n_tokens, -1)\n"
    "            candidates = biased.masked_fill(~keep_expert, 0.0)\n"
    "            _, topk_idx = torch.topk(candidates, k=self.top_k, dim=-1, sorted=False)\n"
    "            topk_weight = scores.gather(1, topk_idx)\n"
)
ATTENTION_TABLE = '    "flash_attention_2": DeepseekV2FlashAttention2,\n}\n'
MHA_ROWS = '    "mha_eager": LlamaAttention,\n    "mha_flash_attention_2": LlamaFlashAttention2,\n'
LAYER_ATTENTION = "ATTENTION_CLASSES[config._attn_implementation]("
MHA_CHOICE = 'ATTENTION_CLASSES[("" if config.use_mla else "mha_") + config._attn_implementation]('

WRAPPER = '''"""The auto_map module of an OCR-style checkpoint: the language model comes from a module beside it."""

from .configuration_deepseek import DeepseekV2Config
from .modeling_deepseekv2 import DeepseekV2ForCausalLM


class DeepseekOCRConfig(DeepseekV2Config):
    model_type = "deepseek_ocr_stand_in"

    def __init__(self, **kwargs):  # its own, so that transformers 5.x does not make it a dataclass without defaults
        super().__init__(**kwargs)


class DeepseekOCRForCausalLM(DeepseekV2ForCausalLM):
    config_class = DeepseekOCRConfig
'''


def edit(text: str, anchor: str, new: str, before: bool = True) -> str:
    assert text.count(anchor) == 1, anchor
    return text.replace(anchor, new + anchor if before else anchor + new)


def language_model(guard: str = NOAUX_GUARD) -> str:
    """The V2 stand-in with the noaux_tc router branch (its training guard spelled `guard`) and the Llama rows."""
    text = (V2 / "modeling_deepseek.py").read_text()
    text = edit(text, "from .configuration_deepseek import", LLAMA_IMPORT)
    text = edit(text, GATE_INIT, BIAS)
    text = edit(text, SCORING_ELSE, SIGMOID)
    text = edit(text, TOPK_ELSE, NOAUX.replace(NOAUX_GUARD, guard))
    text = edit(text, ATTENTION_TABLE, MHA_ROWS)
    return text.replace(LAYER_ATTENTION, MHA_CHOICE)


def config(**overrides) -> dict:
    data = json.loads((V2 / "config.json").read_text())
    data["auto_map"] = {
        "AutoConfig": "modeling_deepseekocr.DeepseekOCRConfig",
        "AutoModel": "modeling_deepseekocr.DeepseekOCRForCausalLM",
        "AutoModelForCausalLM": "modeling_deepseekocr.DeepseekOCRForCausalLM",
    }
    data.update(
        model_type="deepseek_ocr_stand_in",
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        norm_topk_prob=True,
        use_mla=True,
        pretraining_tp=1,
    )
    return {**data, **overrides}


def write_checkpoint(path: Path, wrapper: str = WRAPPER, model: str | None = None, **overrides) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config(**overrides), indent=2) + "\n")
    (path / "configuration_deepseek.py").write_bytes((V2 / "configuration_deepseek.py").read_bytes())
    (path / "modeling_deepseekocr.py").write_text(wrapper)
    (path / "modeling_deepseekv2.py").write_text(language_model() if model is None else model)
    return path
