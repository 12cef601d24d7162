"""The methods an evaluation compares, each a ``Method``: ``(messages, prompt_ids, sampling, max_new, seed)
-> Output``. In-process GRIFFIN and vanilla decoding (``local_decoder``), HF ``generate``, prompt lookup and
assisted generation (``hf_decoder``), and the Serve endpoint (``endpoint_decoder``); ``build_methods``
assembles the set a config asks for."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from griffin.config import SamplingConfig, TreeConfig
from griffin.decode import speculative_generate, vanilla_generate
from griffin.policy import SpeculationPolicy, sampling_table
from pipeline.config import RunConfig, TargetSection
from pipeline.resources.drafts import load_draft_uri
from pipeline.resources.targets import load_target
from pipeline.serve.protocol import completion_text

logger = logging.getLogger(__name__)


PROMPT_LOOKUP_TOKENS = 10  # HF's documented example value for prompt_lookup_num_tokens


@dataclass
class Output:
    text: str
    new_tokens: int  # stop token included, as decoded
    seconds: float  # wall time of the whole call, prefill included
    tokens: list[int] | None = None  # None through the endpoint, which returns text
    accepted_per_round: list[int] | None = None  # speculative methods only
    draft_seconds: float | None = None  # in-process speculative methods: drafting (catch-up + tree), all rounds
    verify_seconds: float | None = None  # ... and the target's verify passes with acceptance


# messages, prompt ids, sampling, max_new_tokens, seed -> Output
Method = Callable[[list[dict[str, str]], list[int], SamplingConfig, int, int], Output]


def local_decoder(
    target: Any, draft: Any | None = None, tree: TreeConfig | None = None, sampling_tree: TreeConfig | None = None
) -> Method:
    """Our decoder in this process: speculative with ``draft`` and ``tree`` (``sampling_tree`` at
    T > 0 when set: the rule of a replica's policy, ``SpeculationPolicy.tree_for``), vanilla without."""
    policy = SpeculationPolicy({1: tree}, sampling_table({1: tree}, sampling_tree))

    def run(messages, prompt_ids, sampling, max_new, seed) -> Output:
        ids = torch.tensor([prompt_ids], device=target.device)  # (1, T)
        start = time.perf_counter()
        if draft is None:
            result = vanilla_generate(target, ids, sampling, max_new, seed)
        else:
            used = policy.tree_for(1, sampling=not sampling.greedy)
            result = speculative_generate(target, draft, ids, used, sampling, max_new, seed)
        seconds = time.perf_counter() - start
        text = completion_text(target.tokenizer, result.tokens, target.stop_token_ids, [])[0]
        if draft is None:
            return Output(text, len(result.tokens), seconds, result.tokens)
        stats = result.stats
        return Output(
            text,
            len(result.tokens),
            seconds,
            result.tokens,
            stats.accepted_per_round,
            stats.draft_time,
            stats.verify_time,
        )

    return run


def hf_decoder(target: Any, **generate_kwargs: Any) -> Method:
    """HF ``generate`` on the same weights (plain, prompt lookup or an assistant model)."""
    pad = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else target.stop_token_ids[0]

    def run(messages, prompt_ids, sampling, max_new, seed) -> Output:
        ids = torch.tensor([prompt_ids], device=target.device)  # (1, T)
        kwargs = dict(
            max_new_tokens=max_new,
            eos_token_id=target.stop_token_ids,
            pad_token_id=pad,
            attention_mask=torch.ones_like(ids),
            **generate_kwargs,
        )
        if sampling.greedy:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        else:  # top_k=0: off, as in our sampler (HF's default would be 50)
            kwargs.update(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k)
        torch.manual_seed(seed)
        start = time.perf_counter()
        with torch.inference_mode():
            tokens = target.model.generate(ids, **kwargs)[0, ids.shape[1] :].tolist()
        seconds = time.perf_counter() - start
        text = completion_text(target.tokenizer, tokens, target.stop_token_ids, [])[0]
        return Output(text, len(tokens), seconds, tokens)

    return run


def endpoint_decoder(client: Any, url: str, speculative: bool) -> Method:
    """The Serve endpoint; ``speculative=False`` asks it to decode without the draft. The endpoint
    returns the emitted token ids (``return_token_ids``), so a T=0 divergence is located at the token
    level with its logit gap (``first_divergence``) in through_serve mode too."""

    def run(messages, prompt_ids, sampling, max_new, seed) -> Output:
        body = {
            "messages": messages,
            "max_tokens": max_new,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k,
            "seed": seed,
            "speculative": speculative,
            "return_token_ids": True,
        }
        start = time.perf_counter()
        response = client.post(f"{url}/v1/chat/completions", json=body, timeout=600)
        seconds = time.perf_counter() - start
        if response.status_code != 200:
            raise RuntimeError(f"{url} answered {response.status_code}: {response.text[:300]}")
        data = response.json()
        spec = data["speculative"]
        return Output(
            data["choices"][0]["message"]["content"],
            data["usage"]["completion_tokens"],
            seconds,
            tokens=spec.get("token_ids"),  # absent from a server that predates return_token_ids
            accepted_per_round=spec["accepted_per_round"] if spec["enabled"] else None,
        )

    return run


def load_drafts(cfg: RunConfig, target: Any, draft: Any) -> dict[str, Any]:
    """The draft model of each speculative method: ``griffin`` and every ``eval.extra_drafts`` label."""
    drafts = {"griffin": draft}
    for label, uri in cfg.eval.extra_drafts.items():
        if label in ("griffin", "vanilla") or label.startswith("hf_"):
            raise ValueError(f"eval.extra_drafts label {label!r} collides with a method name; pick another")
        drafts[label] = load_draft_uri(uri, target, cfg)
    return drafts


def build_methods(
    cfg: RunConfig, target: Any, drafts: dict[str, Any], draft_uri: str | None
) -> tuple[dict[str, Method], bool]:
    """Methods in report order, and whether this call started Serve (through_serve with none running)."""
    evaluation, started = cfg.eval, False
    if evaluation.through_serve:
        methods, started = _endpoint_methods(cfg, draft_uri)
    else:
        griffin = local_decoder(target, drafts["griffin"], cfg.eval_tree, cfg.decode.sampling_tree)
        methods = {"griffin": griffin, "vanilla": local_decoder(target)}
    for label, draft in drafts.items():
        if label != "griffin":
            methods[label] = local_decoder(target, draft, cfg.eval_tree, cfg.decode.sampling_tree)
    stock = _stock(cfg, target) if any(b.startswith("hf_") for b in evaluation.baselines) else target
    if "hf_generate" in evaluation.baselines:
        methods["hf_generate"] = hf_decoder(stock)
    if "hf_prompt_lookup" in evaluation.baselines:
        methods["hf_prompt_lookup"] = hf_decoder(stock, prompt_lookup_num_tokens=PROMPT_LOOKUP_TOKENS)
    if "hf_assisted" in evaluation.baselines:
        methods["hf_assisted"] = hf_decoder(stock, assistant_model=_assistant(cfg, target).model)
    return methods, started


def _endpoint_methods(cfg: RunConfig, draft_uri: str | None) -> tuple[dict[str, Method], bool]:
    """GRIFFIN and vanilla through the endpoint (started with ``draft_uri`` when none is running)."""
    import httpx

    from pipeline.serve.auth import client_headers
    from pipeline.serve.deployment import public_name
    from pipeline.serve.lifecycle import ensure_serving

    if draft_uri is None:
        raise ValueError("eval.through_serve needs the draft as a URI or directory, not an in-memory model")
    # a deployment this call starts decodes with the evaluation tree, the tree the report names
    serving = cfg.model_copy(
        update={
            "serve": cfg.serve.model_copy(update={"draft_uri": draft_uri}),
            "decode": cfg.decode.model_copy(update={"tree": cfg.eval_tree}),
        }
    )
    url, started = ensure_serving(serving)
    client = httpx.Client(headers=client_headers(cfg.serve))
    served = client.get(f"{url}/v1/models").json()["data"][0]
    if served["draft"] != public_name(draft_uri):
        logger.warning(
            "%s serves draft %s, not %s: the endpoint numbers are that draft's", url, served["draft"], draft_uri
        )
    if served["tree"] != cfg.eval_tree.model_dump():
        logger.warning(
            "%s decodes with tree %s, not the evaluation tree %s: the endpoint numbers are that tree's",
            url,
            served["tree"],
            cfg.eval_tree.model_dump(),
        )
    methods = {"griffin": endpoint_decoder(client, url, True), "vanilla": endpoint_decoder(client, url, False)}
    return methods, started


def _stock(cfg: RunConfig, target: Any) -> Any:
    """The HF baselines run stock transformers: an unpacked copy when ours is pre-packed, so that
    'vs HF' measures what a user gets out of the box, and 'vs vanilla' isolates speculation."""
    return load_target(cfg.target) if target.packed else target


def _assistant(cfg: RunConfig, target: Any) -> Any:
    """The smaller model for HF assisted generation; it must share the target's tokenizer."""
    if not cfg.eval.assistant_model:
        raise ValueError(
            "eval.baselines lists hf_assisted but eval.assistant_model is not set: name a smaller "
            "model with the target's tokenizer (e.g. qwen2.5-coder-0.5b-instruct) or drop hf_assisted"
        )
    assistant = load_target(
        TargetSection(name=cfg.eval.assistant_model, dtype=cfg.target.dtype, device=cfg.target.device)
    )
    if assistant.tokenizer.get_vocab() != target.tokenizer.get_vocab():
        raise ValueError(f"eval.assistant_model {cfg.eval.assistant_model!r} does not share the target's tokenizer")
    return assistant
