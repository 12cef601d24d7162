"""The registered model as an MLflow pyfunc that generates text: the draft and its target, decoding
speculatively.

``mlflow.pyfunc.load_model("models:/<name>@champion").predict(pd.DataFrame({"prompt": [...]}),
params={"max_new_tokens": 64, "temperature": 0.0})`` returns one completion per prompt: each prompt is a
user turn through the target's chat template (``pipeline.data.chat.render_chat``, as the server renders
it), decoded by ``griffin.decode.speculative_generate`` and cut at the stop token like the server's text
(``completion_text``).

``pipeline.registry.register`` logs this file as models-from-code: MLflow stores it with the model and
runs it at load time, after putting the model's ``code_paths`` (this repository's ``griffin`` and
``pipeline`` packages) on ``sys.path``; nothing is pickled. The model's config (``model_config``)
records the ``target`` section that registration checked the draft's lineage against, the trees
(``decode.tree``; ``decode.sampling_tree`` at T > 0, the rule of a replica's policy), the context cap
(``decode.max_context``: prompt + new tokens, and the KV cache's size) and the default ``params``;
loading builds that target, checks the lineage again and binds the draft to it.
``load_model(uri, model_config={"device": "cuda", "max_context": 4096})`` places the target elsewhere
than recorded, or caps it otherwise.
"""

from __future__ import annotations

from typing import Any

import mlflow


class SpeculativePyfunc(mlflow.pyfunc.PythonModel):
    def load_context(self, context) -> None:
        from griffin.config import TreeConfig
        from griffin.policy import SpeculationPolicy, sampling_table
        from pipeline.config import DecodeSection, TargetSection
        from pipeline.resources.drafts import ARTIFACT_KEY, load_draft_dir
        from pipeline.resources.targets import load_target

        config = context.model_config
        section = TargetSection(**config["target"])
        if config.get("device"):
            section = section.model_copy(update={"device": config["device"]})
        # a version registered before its cap was recorded: decode.max_context's default, not the whole context
        max_context = config.get("max_context", DecodeSection.model_fields["max_context"].default)
        self.target = load_target(section, decoding=True, max_context=max_context)
        self.draft = load_draft_dir(context.artifacts[ARTIFACT_KEY], self.target, "the registered model's draft")
        # the rule of a replica's policy (SpeculationPolicy.tree_for): ``sampling_tree`` for T > 0 when set;
        # a version registered before it was recorded has none
        sampling_tree = TreeConfig(**config["sampling_tree"]) if config.get("sampling_tree") else None
        trees = {1: TreeConfig(**config["tree"])}
        self.policy = SpeculationPolicy(trees, sampling_table(trees, sampling_tree))
        self.defaults = dict(config.get("params") or {})

    # model_input has no type hint: MLflow would derive an input schema from it (the signature has one)
    def predict(self, context, model_input, params: dict[str, Any] | None = None) -> list[str]:
        import torch

        from griffin.config import SamplingConfig
        from griffin.decode import speculative_generate
        from pipeline.data.chat import render_chat
        from pipeline.serve.protocol import completion_text

        settings = {**self.defaults, **(params or {})}
        temperature = float(settings.get("temperature", 0.0))
        sampling = SamplingConfig(
            temperature=temperature, top_p=float(settings.get("top_p", 1.0)) if temperature else 1.0
        )
        texts = []
        for prompt in prompts(model_input):
            prompt_ids = render_chat(self.target.tokenizer, [{"role": "user", "content": prompt}])
            max_new = min(int(settings.get("max_new_tokens", 64)), self.target.max_context - len(prompt_ids))
            seed = int(settings.get("seed", 0))
            ids = torch.tensor([prompt_ids], device=self.target.device)  # (1, T)
            tree = self.policy.tree_for(1, sampling=not sampling.greedy)
            result = speculative_generate(self.target, self.draft, ids, tree, sampling, max_new, seed)
            texts.append(completion_text(self.target.tokenizer, result.tokens, self.target.stop_token_ids, [])[0])
        return texts


def prompts(model_input: Any) -> list[str]:
    """The prompts of a pyfunc input: a DataFrame's ``prompt`` column (or its only column), a Series,
    or ``{"prompt": ...}``; each cell one prompt or a list of them. MLflow hands ``predict`` the
    ``{"prompt": ["a", "b"]}`` form as one row whose cell is the whole list: it is two prompts."""
    if hasattr(model_input, "columns"):  # a pandas DataFrame
        column = "prompt" if "prompt" in model_input.columns else model_input.columns[0]
        model_input = model_input[column]
    elif isinstance(model_input, dict):
        model_input = model_input["prompt"]
    cells = [model_input] if isinstance(model_input, str) else list(model_input)
    return [str(item) for cell in cells for item in ([cell] if isinstance(cell, str) or not _listlike(cell) else cell)]


def _listlike(cell: Any) -> bool:
    """A list, tuple or array of prompts in one cell (a numpy array when MLflow built the frame)."""
    return isinstance(cell, (list, tuple)) or getattr(cell, "ndim", 0) == 1


mlflow.models.set_model(SpeculativePyfunc())
