# Re-decode the one T=0 divergence that benchmarks/variants/variants.sh flagged (griffin3, HumanEval question 0,
# index 59, bf16 gap 0.5) in fp32: speculative vs vanilla, and the fp32 logit gap there.
#   .venv/bin/python benchmarks/variants/fp32_recheck.py

"""One T=0 divergence re-decoded in fp32 (see the comment above)."""

import torch

from pipeline.config import load_config
from pipeline.data.chat import render_chat
from pipeline.resources.drafts import load_draft_uri
from pipeline.resources.questions import load_questions
from pipeline.resources.targets import load_target
from griffin.decode import speculative_generate, vanilla_generate
from griffin.config import SamplingConfig, TreeConfig


def main() -> None:
    cfg = load_config("jobs/configs/smollm2-variants.yaml", ["target.dtype=float32"])
    target = load_target(cfg.target)
    draft = load_draft_uri("outputs/smollm2-variants-griffin3/train/best", target, cfg, dtype=torch.float32)
    q = load_questions("humaneval", 1)[0]
    msgs = [{"role": "user", "content": q["turns"][0]}]
    ids = torch.tensor([render_chat(target.tokenizer, msgs)])  # (1, T)
    tree = TreeConfig(total_tokens=12, depth=3, top_k=10)
    a = speculative_generate(target, draft, ids, tree, SamplingConfig(), 96)
    b = vanilla_generate(target, ids, SamplingConfig(), 96)
    print("fp32 equal:", a.tokens == b.tokens, len(a.tokens), len(b.tokens))
    i = 59
    ctx = torch.cat([ids, torch.tensor([b.tokens[:i]])], 1)
    with torch.no_grad():
        logits = target.model(ctx).logits[0, -1].float()
    top = logits.topk(3)
    print(
        "fp32 vanilla at 59: top",
        top.indices.tolist(),
        [round(v, 3) for v in top.values.tolist()],
        "logit[2]",
        round(logits[2].item(), 3),
        "logit[378]",
        round(logits[378].item(), 3),
    )


if __name__ == "__main__":
    main()
