"""Our model against transformers' DeepseekV3/V2ForCausalLM on the same tiny random
checkpoints (q_lora on/off, YaRN on/off, noaux_tc / greedy / group_limited_greedy routing,
interleaved and plain rope)."""

import pytest
import torch

from matrixinfer import LLM, SamplingParams
from matrixinfer.model.loader import load_model
from tests.hf_fixtures import make_checkpoint
from tests.paged import PagedSequence


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


def test_prefill_logits_match_transformers(hf_checkpoint):
    """Dense prefill logits equal HF's in float32 (relative error < 1e-4)."""
    path, hf = hf_checkpoint
    ours = load_model(path, dtype="float32")
    ids = torch.randint(0, ours.config.vocab_size, (2, 23), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids).logits
        out = ours.compute_logits(ours(ids, torch.arange(23).expand(2, 23)))
    assert rel_err(out, ref) < 1e-4


def test_paged_decode_steps_match_transformers(hf_checkpoint):
    """Prefill then one token at a time through the paged latent cache (absorbed MLA decode):
    every step's logits equal HF's full-sequence logits at that position."""
    path, hf = hf_checkpoint
    ours = load_model(path, dtype="float32")
    ids = torch.randint(0, ours.config.vocab_size, (1, 30), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits[0]
    seq = PagedSequence(ours, num_blocks=16, block_size=4)
    assert rel_err(seq.step(ids[0, :10].tolist()), ref[9]) < 1e-4
    for t in range(10, 30):
        assert rel_err(seq.step([int(ids[0, t])]), ref[t]) < 1e-4, f"step {t}"


def test_absorbed_and_unabsorbed_attention_agree(hf_checkpoint):
    """The weight-absorbed decode path over latents equals up-projecting K/V and attending."""
    path, _ = hf_checkpoint
    attn = load_model(path, dtype="float32").model.layers[0].self_attn
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 12, attn.o_proj.output_size, generator=g)
    pos = torch.arange(12).expand(3, 12)
    with torch.no_grad():
        q_nope, q_pe, c_kv, k_pe = attn.prolog(x, attn.rotary.cos_sin(pos, x.dtype))
        full = attn._attend_unabsorbed(q_nope, q_pe, c_kv, k_pe, causal_offset=0)[:, -1]
        latents = torch.cat([c_kv, k_pe], dim=-1)
        absorbed = attn._attend_absorbed(q_nope[:, -1], q_pe[:, -1], latents, torch.full((3,), 12))
    assert rel_err(absorbed, full) < 1e-5


def test_greedy_generation_token_identical(hf_checkpoint, enforce_eager=True):
    """Engine greedy output (chunked prefill, small blocks, batch of 4) equals HF generate for 32 tokens."""
    path, hf = hf_checkpoint
    llm = LLM(model=path, dtype="float32", block_size=4, max_num_batched_tokens=24, enforce_eager=enforce_eager,
              max_num_seqs=4)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, llm.engine.model_config.vocab_size, (n,), generator=g).tolist() for n in (5, 17, 9, 30)]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for p, o in zip(prompts, outs):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                           eos_token_id=None)[0, len(p):]
        assert o.outputs[0].token_ids == ref.tolist()
    compiled = llm.engine.worker.runner.compiled_decode
    assert (compiled is None) == enforce_eager
    if compiled is not None:
        assert compiled.steps > 20  # the 32-token decodes went through it (after the warm-up calls)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["v3-noqlora", "v2-greedy"])
def test_greedy_generation_token_identical_with_the_compiled_decode_step(tmp_path, variant):
    """The same check with decode steps through the torch.compile'd forward (the default of
    `serve`): batches of decode tokens compiled, steps with prefill chunks eager. Two variants:
    compiling costs tens of seconds per engine on two cores."""
    test_greedy_generation_token_identical((tmp_path, make_checkpoint(tmp_path, variant)), enforce_eager=False)
