"""The planner's QLoRA row (`LoraOptions(quantize=QuantConfig())`, `--quantize nf4`): the adapted bases counted as
torchao's NF4 bytes, no processes.

- At tp=1 the weights row equals, byte for byte, what the quantized peft model holds: torchao's NF4 codes,
  int8 scales and fp32 group factors of every adapted base, the rest in fp32.
- Without the quantization the row is the fp32 bases' (the row a wrong rule would keep).
- The buffers row holds the largest NF4 base's dequantization temporaries, and nothing without QLoRA.
- `--quantize` without `--lora-rank` is one line.
"""

import pytest
import torch
import transformers as tfm

from meshboost.booster import QuantConfig
from meshboost.booster.qlora import quantize_bases_
from meshboost.distributed.quantized import is_nf4
from meshboost.plan import Layout, Planner
from meshboost.plan.lora import DEQUANT_BYTES, LoraOptions

peft = pytest.importorskip("peft")
pytest.importorskip("torchao")
TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
CONFIG = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=512, max_position_embeddings=64, use_cache=False,
              tie_word_embeddings=False)
QUANT = QuantConfig(scaler_block_size=16)


def _held_bytes(model) -> int:
    total = 0
    for p in model.parameters():
        if is_nf4(p):
            total += sum(t.numel() * t.element_size() for t in (p.quantized_data, p.quantized_scalers,
                                                                  p.quantization_factor))
        else:
            total += p.numel() * p.element_size()
    return total


def _rows(quant):
    planner = Planner(tfm.LlamaConfig(**CONFIG), gpus=1, seq=64, global_batch=1, precision="fp32", device="cpu",
                      lora=LoraOptions(4, TARGETS, quantize=quant))
    return planner.explain(Layout.of(tp=1, dp=1, precision="fp32")).memory_bytes_per_rank


def test_weights_row_is_torchaos_bytes():
    torch.manual_seed(0)
    model = peft.get_peft_model(tfm.LlamaForCausalLM(tfm.LlamaConfig(**CONFIG)).float(),
                                peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS.split(",")))
    plain = _held_bytes(model)
    quantize_bases_(model, QUANT)
    quantized = _held_bytes(model)
    with_nf4, without = _rows(QUANT), _rows(None)
    assert without["weights"] == plain
    assert with_nf4["weights"] == quantized < plain
    largest = 256 * 128                                   # gate/up/down: the largest adapted base
    assert with_nf4["buffers"] - without["buffers"] == int(DEQUANT_BYTES["fp32"] * largest)


def test_quantize_needs_lora_rank(capsys):
    from meshboost.plan.__main__ import main
    with pytest.raises(SystemExit):
        main(["--model", "llama", "--quantize", "nf4"])
    assert "--quantize adapt nothing without --lora-rank" in capsys.readouterr().err
