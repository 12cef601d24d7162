"""Run by tests/griffin/test_export_eagle3.py in a subprocess with .venv/speculators on PYTHONPATH: load our
EAGLE-3 exports with vLLM speculators' own classes and report what they hold and compute.

    python tests/griffin/speculators_check.py SPECULATORS_DIR SPECFORGE_DIR VERIFIER_DIR REFERENCE.pt SCRATCH

- SPECULATORS_DIR is loaded with ``Eagle3DraftModel.from_pretrained``; its first draft step's logits
  on REFERENCE's inputs are compared with ours.
- SPECFORGE_DIR goes through speculators' ``Eagle3Converter`` (the path from SpecForge checkpoints
  to vLLM), which writes SCRATCH; that is loaded the same way.
Prints one JSON line per directory: the config fields read, the keys, the max weight difference
against the file and the max logit difference against REFERENCE.
"""

import json
import sys

import torch
from safetensors.torch import load_file


def check(path: str, reference: dict) -> dict:
    from speculators import SpeculatorModelConfig
    from speculators.models.eagle3 import Eagle3DraftModel

    config = SpeculatorModelConfig.from_pretrained(path)
    config.transformer_layer_config._attn_implementation = "eager"  # flex attention needs a compiler here
    model = Eagle3DraftModel.from_pretrained(path, config=config, dtype=torch.float32).eval()
    saved, loaded = load_file(f"{path}/model.safetensors"), model.state_dict()
    weight_diff = max((loaded[k].double() - v.double()).abs().max().item() for k, v in saved.items() if k in loaded)
    captured = []
    model.lm_head.register_forward_hook(lambda module, inputs, output: captured.append(output))
    T = reference["tokens"].shape[1]
    with torch.no_grad():  # one draft step over T positions: (f_t, token_t) -> logits over the draft vocabulary
        model(
            hidden_states=reference["features"],
            input_ids=reference["tokens"],
            document_ids=torch.zeros(1, T, dtype=torch.long),
            position_ids=torch.arange(T)[None],
            ttt_steps=1,
        )
    return {
        "config": type(config).__name__,
        "layers": config.eagle_aux_hidden_state_layer_ids,
        "draft_vocab_size": config.draft_vocab_size,
        "verifier": config.speculators_config.verifier.name_or_path,
        "file_keys": sorted(saved),
        "model_keys": sorted(loaded),
        "weight_diff": weight_diff,
        "logit_diff": (captured[0] - reference["logits"]).abs().max().item(),
        "d2t": saved["d2t"].tolist() if "d2t" in saved else None,
    }


def main(speculators_dir: str, specforge_dir: str, verifier: str, reference_path: str, scratch: str) -> None:
    from speculators.convert.eagle.eagle3_converter import Eagle3Converter

    reference = torch.load(reference_path, weights_only=True)
    print(json.dumps({"layout": "speculators", **check(speculators_dir, reference)}))
    specforge_ids = json.loads(open(f"{specforge_dir}/config.json").read())["eagle_config"][
        "eagle_aux_hidden_state_layer_ids"
    ]
    # the converter takes vLLM's numbering (HF hidden_states indices): SpecForge's layer outputs + 1
    Eagle3Converter().convert(
        specforge_dir,
        scratch,
        base_model=verifier,
        validate=True,
        eagle_aux_hidden_state_layer_ids=[i + 1 for i in specforge_ids],
    )
    print(json.dumps({"layout": "specforge", **check(scratch, reference)}))


if __name__ == "__main__":
    main(*sys.argv[1:])
