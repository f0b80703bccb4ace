"""Regenerate the example ComfyUI workflows (UI and API format) from the node schemas.

    python examples/comfyui/make_workflows.py

Each workflow is written twice: ``<name>.json`` (open it in ComfyUI: drag it onto the canvas)
and ``<name>.api.json`` (POST it to ComfyUI's ``/prompt`` as ``{"prompt": ...}``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from comfy_nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS  # noqa: E402

# The file names ComfyUI's own Krea 2 repackaging uses (models/diffusion_models, text_encoders, vae).
TURBO_FILE, RAW_FILE = "krea2_turbo_bf16.safetensors", "krea2_raw_bf16.safetensors"
LORA_FILE = "krea2-style-lora.safetensors"
STYLE_LORA_FILE = "krea2_style_reference.safetensors"  # the community style-reference LoRA
STYLE_IMAGES = ("style_ref_1.png", "style_ref_2.png")
TEXT_ENCODER_FILE, VAE_FILE = "qwen3vl_4b_bf16.safetensors", "qwen_image_vae.safetensors"

# The two core nodes the examples use (their schemas, as ComfyUI declares them).
CORE_NODES = {
    "LoadImage": {"inputs": {"required": {"image": ([], {"image_upload": True})}}, "outputs": ("IMAGE", "MASK"),
                  "names": ("IMAGE", "MASK")},
    "SaveImage": {"inputs": {"required": {"images": ("IMAGE", {}), "filename_prefix": ("STRING", {"default": "ComfyUI"})}},
                  "outputs": (), "names": ()},
}
WIDGET_TYPES = ("INT", "FLOAT", "STRING", "BOOLEAN")
TITLES = {**NODE_DISPLAY_NAME_MAPPINGS, "LoadImage": "Load Image", "SaveImage": "Save Image"}


def schema(class_type: str):
    if class_type in CORE_NODES:
        node = CORE_NODES[class_type]
        return node["inputs"], node["outputs"], node["names"]
    cls = NODE_CLASS_MAPPINGS[class_type]
    return cls.INPUT_TYPES(), cls.RETURN_TYPES, getattr(cls, "RETURN_NAMES", cls.RETURN_TYPES)


def is_widget(spec) -> bool:
    return isinstance(spec[0], list) or spec[0] in WIDGET_TYPES


def loader(model, variant):
    return ("Krea2ModelLoader", {"model": model, "variant": variant, "text_encoder": TEXT_ENCODER_FILE, "vae": VAE_FILE,
                                 "dtype": "bfloat16", "memory": "auto"})


def sampler(prompt, steps, guidance, negative="", seed=42, **links):
    return ("Krea2Sampler", {"pipeline": None, "prompt": prompt, "negative_prompt": negative, "width": 1024, "height": 1024,
                             "steps": steps, "guidance": guidance, "seed": seed, "batch_size": 1, "style_mode": "reference", "denoise": 1.0,
                             "reference_method": "index_timestep_zero", "guidance_interval_low": 0.0,
                             "guidance_interval_high": 1.0, **links})


def save(prefix):
    return ("SaveImage", {"images": None, "filename_prefix": prefix})


# name -> {node id: (class_type, inputs)}; an input given as (node id, slot) is a link.
WORKFLOWS = {
    "krea2_turbo_text_to_image": {
        1: loader(TURBO_FILE, "turbo"),
        2: sampler("A red fox asleep in fresh snow, morning light, 35mm photo", 8, 0.0),
        3: save("krea2_turbo"),
        "links": {(2, "pipeline"): (1, 0), (3, "images"): (2, 0)},
    },
    "krea2_raw_lora": {
        1: loader(RAW_FILE, "raw"),
        2: ("Krea2LoraLoader", {"pipeline": None, "lora_name": LORA_FILE, "strength": 1.0}),
        3: sampler("A lighthouse on a cliff at dusk, oil painting", 52, 3.5, negative="blurry, low quality"),
        4: save("krea2_raw_lora"),
        "links": {(2, "pipeline"): (1, 0), (3, "pipeline"): (2, 0), (4, "images"): (3, 0)},
    },
    "krea2_style_references": {
        1: loader(TURBO_FILE, "turbo"),
        2: ("LoadImage", {"image": STYLE_IMAGES[0]}),
        3: ("LoadImage", {"image": STYLE_IMAGES[1]}),
        4: ("Krea2StyleReference", {"image": None, "strength": 0.8}),
        5: ("Krea2StyleReference", {"image": None, "strength": 0.4, "style_refs": None}),
        6: sampler("A cat reading a newspaper in a cafe", 8, 0.0, style_refs=None),
        7: save("krea2_style"),
        8: ("Krea2LoraLoader", {"pipeline": None, "lora_name": STYLE_LORA_FILE, "strength": 1.0}),
        "links": {(8, "pipeline"): (1, 0), (4, "image"): (2, 0), (5, "image"): (3, 0), (5, "style_refs"): (4, 0),
                  (6, "pipeline"): (8, 0), (6, "style_refs"): (5, 0), (7, "images"): (6, 0)},
    },
    "krea2_prompt_expander": {
        1: loader(TURBO_FILE, "turbo"),
        2: ("Krea2PromptExpander", {"pipeline": None, "prompt": "a cosy reading nook", "creativity": "medium", "seed": 7,
                                    "max_new_tokens": 512}),
        3: sampler("", 8, 0.0),
        4: save("krea2_expanded"),
        "links": {(2, "pipeline"): (1, 0), (3, "pipeline"): (1, 0), (3, "prompt"): (2, 0), (4, "images"): (3, 0)},
    },
}


def api_format(graph) -> dict:
    out = {}
    for node_id, (class_type, inputs) in ((k, v) for k, v in graph.items() if k != "links"):
        values = {}
        for name, value in inputs.items():
            link = graph["links"].get((node_id, name))
            if link is not None:
                values[name] = [str(link[0]), link[1]]
            elif value is not None:
                values[name] = value
        out[str(node_id)] = {"inputs": values, "class_type": class_type, "_meta": {"title": TITLES.get(class_type, class_type)}}
    return out


def ui_format(graph) -> dict:
    node_ids = [k for k in graph if k != "links"]
    links = [(i + 1, src[0], src[1], dst_id, name) for i, ((dst_id, name), src) in enumerate(graph["links"].items())]
    depth = {}

    def depth_of(node_id):  # column of the layout: one more than the deepest input
        if node_id not in depth:
            sources = [src for (dst, _), src in graph["links"].items() if dst == node_id]
            depth[node_id] = 1 + max((depth_of(src[0]) for src in sources), default=-1)
        return depth[node_id]

    node_ids.sort(key=lambda n: (depth_of(n), n))  # execution order
    rows = {}
    nodes, link_rows = [], []
    for order, node_id in enumerate(node_ids):
        row = rows[depth[node_id]] = rows.get(depth[node_id], -1) + 1
        class_type, values = graph[node_id]
        input_types, outputs, names = schema(class_type)
        inputs, widgets = [], []
        declared = {**input_types.get("required", {}), **input_types.get("optional", {})}
        for name, spec in declared.items():
            link = next((lk for lk in links if lk[3] == node_id and lk[4] == name), None)
            slot = {"name": name, "type": spec[0] if not isinstance(spec[0], list) else "COMBO",
                    "link": link[0] if link else None}
            if is_widget(spec):
                widgets.append(values.get(name, spec[1].get("default")))
                if spec[1].get("control_after_generate"):
                    widgets.append("fixed")
                if spec[1].get("image_upload"):
                    widgets.append("image")
                if link:
                    inputs.append({**slot, "widget": {"name": name}})
            else:
                inputs.append(slot)
        node_links = lambda slot: [lk[0] for lk in links if lk[1] == node_id and lk[2] == slot]
        nodes.append({
            "id": node_id, "type": class_type, "title": TITLES.get(class_type, class_type), "pos": [40 + 380 * depth[node_id], 80 + 320 * row], "size": [340, 280],
            "flags": {}, "order": order, "mode": 0, "inputs": inputs,
            "outputs": [{"name": n, "type": t, "links": node_links(i), "slot_index": i} for i, (t, n) in enumerate(zip(outputs, names))],
            "properties": {"Node name for S&R": class_type}, "widgets_values": widgets,
        })
    for link_id, src_id, src_slot, dst_id, name in links:
        declared = schema(graph[dst_id][0])[0]
        dst_names = [n for n, spec in {**declared.get("required", {}), **declared.get("optional", {})}.items()
                     if not is_widget(spec) or any(lk[3] == dst_id and lk[4] == n for lk in links)]
        link_rows.append([link_id, src_id, src_slot, dst_id, dst_names.index(name), schema(graph[src_id][0])[1][src_slot]])
    return {"last_node_id": max(node_ids), "last_link_id": len(links), "nodes": nodes, "links": link_rows,
            "groups": [], "config": {}, "extra": {}, "version": 0.4}


if __name__ == "__main__":
    for name, graph in WORKFLOWS.items():
        (HERE / f"{name}.json").write_text(json.dumps(ui_format(graph), indent=2) + "\n")
        (HERE / f"{name}.api.json").write_text(json.dumps(api_format(graph), indent=2) + "\n")
        print("wrote", name)
