"""The pretraining recipe's pieces against independent references: Muon (torch's, and gathered
under FSDP2), the AdamW/Muon split, per-stage timestep shift, scratch init, captions, decode failures."""

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from finetune.optimization.timesteps import sample_timesteps
from finetune.packs import PackReader, PackRecord, write_pack
from finetune.pretrain.architecture import build_transformer
from finetune.pretrain.batches import StageBatches, StepData, choose_caption
from finetune.pretrain.config import (CaptionConfig, PretrainModelConfig, PretrainOptimizerConfig, StageConfig,
                                      build_pretrain_config)
from finetune.pretrain.optimizers import GatheredMuon, make_optimizers, split_parameters
from launcher import torchrun

ROOT = Path(__file__).resolve().parents[1]


def test_gathered_muon_is_torch_muon_on_whole_matrices():
    torch.manual_seed(0)
    weights = [torch.randn(24, 16), torch.randn(8, 40)]
    ours = [w.clone().requires_grad_() for w in weights]
    theirs = [w.clone().requires_grad_() for w in weights]
    kwargs = dict(lr=0.01, weight_decay=0.1, momentum=0.95, nesterov=True, adjust_lr_fn="match_rms_adamw")
    a, b = GatheredMuon(ours, **kwargs), torch.optim.Muon(theirs, **kwargs)
    for _ in range(3):
        for p, q in zip(ours, theirs):
            p.grad = torch.randn(p.shape)
            q.grad = p.grad.clone()
        a.step(), b.step()
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
        torch.testing.assert_close(a.state[p]["momentum_buffer"], b.state[q]["momentum_buffer"], rtol=0, atol=0)


def test_gathered_muon_under_fsdp2_matches_one_process():
    torchrun(2, [str(ROOT / "tests/pretrain_muon_worker.py")], timeout=300)


def test_first_and_last_layers_embeddings_and_vectors_stay_on_adamw():
    model = build_transformer(PretrainModelConfig(architecture="tiny"), seed=0)
    split = split_parameters(model, PretrainOptimizerConfig(name="muon"))
    muon = {n for n, _ in split.muon}
    decay, no_decay = {n for n, _ in split.adamw_decay}, {n for n, _ in split.adamw_no_decay}
    assert "transformer_blocks.0.attn.to_q.weight" in muon and "transformer_blocks.1.ff.down.weight" in muon
    assert {"img_in.weight", "final_layer.linear.weight", "time_embed.linear_1.weight"} <= decay
    assert "transformer_blocks.0.norm1.weight" in decay  # zero-centred RMSNorm scales decay (towards 1)
    assert {"img_in.bias", "transformer_blocks.0.scale_shift_table", "final_layer.scale_shift_table"} <= no_decay
    assert all(p.ndim == 2 for _, p in split.muon)
    assert muon | decay | no_decay == {n for n, _ in model.named_parameters()}
    adamw_only, _ = make_optimizers(model, PretrainOptimizerConfig(name="adamw"))
    assert [type(o) for o in adamw_only] == [torch.optim.AdamW]
    off = split_parameters(model, PretrainOptimizerConfig(name="adamw", norm_weight_decay=False))
    assert "transformer_blocks.0.norm1.weight" in {n for n, _ in off.adamw_no_decay}


def test_scratch_init_starts_every_block_as_the_identity_and_predicts_zero():
    model = build_transformer(PretrainModelConfig(architecture="tiny"), seed=3)
    assert not model.final_layer.linear.weight.any() and not model.time_mod_proj.weight.any()
    assert not model.transformer_blocks[0].norm1.weight.any() and model.transformer_blocks[0].attn.to_q.weight.std() > 0
    again = build_transformer(PretrainModelConfig(architecture="tiny"), seed=3)
    torch.testing.assert_close(model.state_dict(), again.state_dict(), rtol=0, atol=0)  # same on every process


def test_init_from_weights_reads_a_diffusers_named_file_and_refuses_other_shapes(tmp_path):
    from finetune.config import ConfigError
    from krea2_diffusers.files import save_safetensors

    source = build_transformer(PretrainModelConfig(architecture="tiny"), seed=5)
    with torch.no_grad():
        for p in source.parameters():
            p.add_(torch.randn(p.shape) * 0.01)  # nothing left at its init value
    save_safetensors(source.state_dict(), tmp_path / "pma.safetensors")
    loaded = build_transformer(PretrainModelConfig(architecture="tiny", init=str(tmp_path / "pma.safetensors")), seed=0)
    torch.testing.assert_close(loaded.state_dict(), source.state_dict(), rtol=0, atol=0)
    other = {"num_layers": 3, "attention_head_dim": 16, "num_attention_heads": 4, "num_key_value_heads": 2,
             "intermediate_size": 128, "timestep_embed_dim": 32, "text_hidden_dim": 32, "text_num_attention_heads": 2,
             "text_num_key_value_heads": 2, "text_intermediate_size": 64, "axes_dims_rope": [4, 6, 6]}
    config = build_pretrain_config({"model": {"architecture": other, "init": str(tmp_path / "pma.safetensors")},
                                    "stages": [{"name": "a", "data": "p"}]})
    with pytest.raises(ConfigError, match="missing.*transformer_blocks.2"):
        build_transformer(config.model, seed=0)


def test_extra_checkpoint_steps_are_checked_against_the_run_and_pma():
    from finetune.config import ConfigError

    stages = [{"name": "a", "data": "p", "steps": 10}, {"name": "b", "data": "q", "steps": 10}]
    config = build_pretrain_config({"stages": stages, "checkpointing": {"every_n_steps": 5, "steps": [2, 13]}})
    assert [s for s in range(1, 21) if config.checkpointing.due(s)] == [2, 5, 10, 13, 15, 20]
    with pytest.raises(ConfigError, match=r"checkpointing.steps: step 21 is outside 1..the stages' total steps \(20\)"):
        build_pretrain_config({"stages": stages, "checkpointing": {"steps": [21]}})
    with pytest.raises(ConfigError, match="checkpointing.steps with pma"):
        build_pretrain_config({"stages": stages, "checkpointing": {"every_n_steps": 5, "steps": [2]},
                               "pma": {"every_n_steps": 5, "num_checkpoints": 2}})


def test_stage_shift_is_the_exponential_shift_of_logit_normal_times():
    config = build_pretrain_config({"stages": [{"name": "a", "data": "p", "shift": 3.0}, {"name": "b", "data": "q"}]})
    objective = config.timestep_objective(config.stages[0])
    t = sample_timesteps(4096, 256, objective, torch.Generator().manual_seed(1))
    u = torch.sigmoid(torch.randn(4096, generator=torch.Generator().manual_seed(1), dtype=torch.float64))
    torch.testing.assert_close(t, (3 * u / (1 + 2 * u)).float())  # shift s: t = s u / (1 + (s - 1) u)
    assert config.timestep_objective(config.stages[1]).shift == "resolution"
    assert config.stage_at(1) == (0, 0) and config.stages[0].lr_scheduler.name == "wsd"


def test_captions_follow_ratios_and_fall_back_to_what_exists():
    row = {"caption_long": "L", "caption_medium": "M", "caption_short": None}
    draws = [choose_caption(row, CaptionConfig(long=0.5, medium=0.0, short=0.5, dropout=0.25),
                            torch.Generator().manual_seed(i))[1] for i in range(400)]
    assert set(draws) == {"L", "M", ""}  # short is missing: its draws fall back to medium
    assert 0.15 < draws.count("") / 400 < 0.35 and 0.3 < draws.count("M") / 400 < 0.45
    assert choose_caption({"caption_long": None, "caption_medium": None, "caption_short": None},
                          CaptionConfig(dropout=0.0), torch.Generator())[1] == ""


def test_a_row_that_fails_to_decode_is_skipped_and_counted(tmp_path):
    records = [PackRecord(image=_png(i), caption_long=f"c{i}", sample_id=f"s{i}") for i in range(8)]
    write_pack(records, tmp_path / "pack", resolution=64, batch_size=4)
    shard = next((tmp_path / "pack").glob("*.parquet"))
    table = pq.read_table(shard)
    images = table.column("image_bytes").to_pylist()
    images[1] = b"\x89PNG broken"
    pq.write_table(table.set_column(1, "image_bytes", pa.array(images, pa.binary())).replace_schema_metadata(table.schema.metadata), shard)
    config = build_pretrain_config({"stages": [{"name": "a", "data": str(tmp_path / "pack"), "resolution": 64,
                                                "batch_size": 4, "steps": 2}]})
    batches = [StageBatches(config.stages[0], PackReader(tmp_path / "pack"), 1, seed=0)]
    items = [StepData(config, batches, rank=0, world_size=1)[step] for step in (1, 2)]  # the pack's two batches
    ids = PackReader(tmp_path / "pack").sample_ids(0, 8)
    item = next(i for i in items if i["failures"])
    other = next(i for i in items if not i["failures"])
    micro = item["micro"][0]
    assert item["failures"] == 1 and micro["sample_ids"] == ids[:1] + ids[2:4] and other["micro"][0]["sample_ids"] == ids[4:]
    # The broken row runs as a black stand-in with zero loss weight: the batch keeps its shape.
    assert micro["valid"].tolist() == [True, False, True, True] and micro["pixels"].shape == (4, 3, 64, 64)
    assert not micro["pixels"][1].any() and micro["pixels"][0].any()


def test_process_count_changes_micro_batches_not_rows():
    stage = StageConfig(name="a", data="x", batch_size=2)

    class Pack:  # the row count is all StageBatches reads
        def __len__(self):
            return 24

    two = StageBatches(stage, Pack(), run_world_size=2, seed=0)  # global batch 4: two groups of 2 rows
    assert two.local_micro_batches(1, 0, 2) == [range(0, 2)] and two.local_micro_batches(1, 1, 2) == [range(2, 4)]
    assert two.local_micro_batches(1, 0, 1) == [range(0, 2), range(2, 4)]  # one process: one bucket per micro-batch
    assert two.local_micro_batches(7, 0, 4) == [range(0, 1)]
    assert two.repa_on(0) is False
    # Whatever the process count, global batch k is the same rows: one group (bucket) per micro-batch.
    for k in range(14):
        for world in (1, 2, 4):
            rows = [list(two.rows(k, p)) for r in range(world) for p in two.local_micro_batches(k, r, world)]
            assert sum(rows, []) == sum(map(list, two.global_rows(k)), [])
            assert all(len({i // 2 for i in part}) == 1 for part in rows)


def test_each_epoch_is_a_new_permutation_of_the_pack_drawn_from_seed_and_epoch():
    stage = StageConfig(name="a", data="x", batch_size=2)

    class Pack:
        def __len__(self):
            return 25  # 12 groups of 2 (the incomplete last row is never used); 6 batches of 4 per epoch

    def epoch_rows(batches, epoch):
        return [i for k in range(6 * epoch, 6 * epoch + 6) for rows in batches.global_rows(k) for i in rows]

    batches = StageBatches(stage, Pack(), run_world_size=2, seed=0)
    orders = [epoch_rows(batches, e) for e in range(3)]
    assert all(sorted(o) == list(range(24)) for o in orders)  # each epoch: every row once
    assert len({tuple(o) for o in orders + [list(range(24))]}) == 4  # each in its own order, not the pack's
    assert all(o[i] // 2 == o[i + 1] // 2 for o in orders for i in range(0, 24, 2))  # groups (buckets) stay whole
    again = StageBatches(stage, Pack(), run_world_size=2, seed=0)
    assert [epoch_rows(again, e) for e in (2, 0, 1)] == [orders[2], orders[0], orders[1]]  # resumable: any order
    assert epoch_rows(StageBatches(stage, Pack(), run_world_size=2, seed=1), 0) != orders[0]


def _png(i):
    import io

    buffer = io.BytesIO()
    Image.new("RGB", (64, 64), (30 * i, 0, 0)).save(buffer, format="PNG")
    return buffer.getvalue()


def test_wsd_schedule_per_stage():
    from finetune.optimization.optim import lr_multiplier

    stage = build_pretrain_config({"stages": [{"name": "a", "data": "p", "steps": 10,
                                               "lr_scheduler": {"warmup_steps": 2, "decay_fraction": 0.5}}]}).stages[0]
    values = [lr_multiplier(k, stage.lr_scheduler, stage.steps) for k in range(11)]
    # 5 decay steps at 1 - i / 6 (torchtitan's progress, finetune/optimization/optim.py): the stage's last update
    # still moves (1/6), the floor 0 is where the stage ends (step 10, after its last update).
    assert values == pytest.approx([0.5, 1, 1, 1, 1, 5 / 6, 4 / 6, 3 / 6, 2 / 6, 1 / 6, 0.0])
    assert values[4] == 1.0 and values[9] > 0 and values[10] == 0.0
