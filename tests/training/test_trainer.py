"""The training loop on a tiny model: it learns, resumes exactly, and stops cleanly on NaN."""

import json
import re

import pytest
import torch

from medusa.config import ModelConfig
from medusa.model import DecoderModel
from medusa.training import trainer as trainer_module
from medusa.training.config import RECIPES_DIR, load_config
from medusa.training.data import Sequences
from medusa.training.trainer import Trainer, TrainingDivergedError


def tiny_base():
    torch.manual_seed(0)
    config = ModelConfig(model_type="llama", vocab_size=48, hidden_size=32, intermediate_size=64, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=128)
    return DecoderModel(config).eval()


def patterned_data(n=48):
    """Sequences with a learnable rule (each token = previous + 3 mod 48) after a random prompt."""
    g = torch.Generator().manual_seed(0)
    seqs, prompts = [], []
    for _ in range(n):
        start = int(torch.randint(48, (1,), generator=g))
        prompt = torch.randint(48, (4,), generator=g).tolist()
        seqs.append(prompt + [(start + 3 * i) % 48 for i in range(20)])
        prompts.append(4)
    return Sequences.from_lists(seqs, prompts)


def make_trainer(tmp_path, *overrides):
    config = load_config(None, [f"output_dir={tmp_path}", "train.max_tokens_per_batch=256", "train.log_every=1",
                                "train.lr=2e-2", "heads.num_heads=2", *overrides])
    return Trainer(config, tiny_base(), patterned_data())


def losses(state):
    return {m["step"]: m["heads_loss"] for m in state.history}


def test_a_few_steps_lower_the_loss(tmp_path):
    state = make_trainer(tmp_path, "train.epochs=20", "train.save_every=0").train()
    curve = losses(state)
    first, last = curve[1], curve[max(curve)]
    assert last < 0.7 * first


def test_resume_gives_the_same_next_losses(tmp_path, monkeypatch):
    straight = losses(make_trainer(tmp_path / "a", "train.epochs=2", "train.save_every=0").train())

    original = Trainer._after_step

    def crash_after_step_4(self, metrics, bar):
        original(self, metrics, bar)
        if self.state.step == 4:
            raise KeyboardInterrupt

    monkeypatch.setattr(Trainer, "_after_step", crash_after_step_4)
    with pytest.raises(KeyboardInterrupt):
        make_trainer(tmp_path / "b", "train.epochs=2", "train.save_every=4").train()
    monkeypatch.setattr(Trainer, "_after_step", original)
    resumed = losses(make_trainer(tmp_path / "b", "train.epochs=2", "train.save_every=4").train(resume=True))
    assert min(resumed) == 5
    for step, loss in resumed.items():
        assert loss == pytest.approx(straight[step], rel=1e-5, abs=1e-6)
    assert json.loads((tmp_path / "b" / "checkpoints" / "step-0000004" / "trainer_state.json").read_text())["step"] == 4


def test_nan_loss_stops_and_keeps_last_good_checkpoint(tmp_path, monkeypatch):
    real_loss = trainer_module.medusa_loss
    calls = {"n": 0}

    def poisoned(*args, **kwargs):
        out = real_loss(*args, **kwargs)
        calls["n"] += 1
        if calls["n"] == 5:
            return type(out)(out.loss * float("nan"), out.per_head_ce, out.per_head_top1, out.num_targets)
        return out

    monkeypatch.setattr(trainer_module, "medusa_loss", poisoned)
    trainer = make_trainer(tmp_path, "train.epochs=3", "train.save_every=2")
    with pytest.raises(TrainingDivergedError, match="step 5.*step-0000004"):
        trainer.train()
    saved = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert saved == ["step-0000002", "step-0000004"]


def test_save_total_limit_keeps_the_newest_checkpoints(tmp_path):
    trainer = make_trainer(tmp_path, "train.epochs=2", "train.save_every=2", "train.save_total_limit=2")
    state = trainer.train()
    saved = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert len(saved) == 2 and saved[-1] == f"step-{state.step:07d}"
    # without a limit every checkpoint stays
    make_trainer(tmp_path / "all", "train.epochs=2", "train.save_every=2").train()
    assert len(list((tmp_path / "all" / "checkpoints").iterdir())) == state.step // 2 + (state.step % 2 > 0)


def test_unknown_config_key_is_named():
    with pytest.raises(ValueError, match="train.learning_rate"):
        load_config(None, ["train.learning_rate=1e-3"])
    with pytest.raises(FileNotFoundError, match="medusa1-smollm2"):
        load_config("no-such-recipe")


@pytest.mark.parametrize("override, error", [
    ("heads.num_heads=0", "heads.num_heads must be an int >= 1, got 0"),
    ("heads.lm_head=own", "heads.lm_head must be one of"),
    ("heads.num_layers=1.5", "config key heads.num_layers must be an int, got 1.5"),
    ("train.epochs=true", "config key train.epochs must be an int, got True"),
    ("data.sources=[]", "data.sources is empty: list at least one prompt file, or leave it out"),
])
def test_bad_settings_fail_before_any_work(override, error):
    """Checked when the config loads, not after the self-distillation they would follow."""
    with pytest.raises(ValueError, match=error):
        load_config(None, [override])


@pytest.mark.parametrize("override, key", [
    ("train.log_every=0", "train.log_every"),  # was a ZeroDivisionError at the first step
    ("eval.tree_nodes=0", "eval.tree_nodes"),  # was an error after training, with no heads saved
    ("eval.tree_nodes=500", "eval.tree_nodes"),  # trees hold at most MAX_NODES (64)
    ("train.decay=0", "train.decay"),
    ("train.decay=-1", "train.decay"),  # negative loss weights: odd heads' loss maximised
    ("train.max_steps=-5", "train.max_steps"),
    ("train.save_every=-1", "train.save_every"),
    ("train.save_total_limit=0", "train.save_total_limit"),
    ("medusa2.lora_r=-3", "medusa2.lora_r"),
    ("medusa2.lora_r=0", "medusa2.lora_r"),
    ("medusa2.lora_alpha=0", "medusa2.lora_alpha"),
    ("medusa2.base_lr=0", "medusa2.base_lr"),
    ("medusa2.heads_weight=-0.1", "medusa2.heads_weight"),
    ("medusa2.heads_weight_warmup_steps=-1", "medusa2.heads_weight_warmup_steps"),
    ("medusa2.target_modules=[]", "medusa2.target_modules"),
    ("train.lr=0", "train.lr"),
    ("train.lr=-1e-3", "train.lr"),
    ("train.lr=.nan", "train.lr"),
    ("train.lr=.inf", "train.lr"),
    ("train.epochs=0", "train.epochs"),
    ("train.warmup_ratio=1", "train.warmup_ratio"),
    ("train.warmup_ratio=-0.1", "train.warmup_ratio"),
    ("train.weight_decay=-0.01", "train.weight_decay"),
    ("train.grad_accum=0", "train.grad_accum"),
    ("train.max_tokens_per_batch=8", "train.max_tokens_per_batch"),
    ("train.max_grad_norm=0", "train.max_grad_norm"),
    ("train.soft_targets=1.5", "train.soft_targets"),
    ("eval.max_rank=0", "eval.max_rank"),
    ("eval.max_sequences=0", "eval.max_sequences"),
    ("data.holdout_fraction=1", "data.holdout_fraction"),
    ("data.distill_batch_size=0", "data.distill_batch_size"),
    ("data.sample_temperature=-0.5", "data.sample_temperature"),
    ("heads.num_heads=0", "heads.num_heads"),
    ("seed=-1", "seed"),
])
def test_out_of_range_settings_are_refused_naming_key_and_value(override, key):
    """Refused when the config is built, before hours of self-distillation, naming the key and the value."""
    with pytest.raises(ValueError, match=rf"^{re.escape(key)} must .*, got \S"):
        load_config(None, [override])


def test_tree_nodes_beyond_what_the_heads_and_ranks_can_fill_are_refused():
    with pytest.raises(ValueError, match=r"eval.tree_nodes must be <= 5 for heads.num_heads=4 and eval.max_rank=1"):
        load_config(None, ["eval.max_rank=1"])
    assert load_config(None, ["eval.max_rank=1", "eval.tree_nodes=5"]).eval.tree_nodes == 5


def test_the_edges_of_each_range_still_load():
    """0 keeps its documented meaning: no step limit, checkpoints only at the end, no lambda ramp."""
    config = load_config(None, ["train.max_steps=0", "train.save_every=0", "train.log_every=1", "eval.tree_nodes=64",
                                "eval.tree_nodes=1", "train.warmup_ratio=0", "medusa2.lora_r=1",
                                "medusa2.heads_weight_warmup_steps=0", "train.max_grad_norm=.inf", "train.decay=1.5"])
    assert (config.train.max_steps, config.train.save_every, config.eval.tree_nodes) == (0, 0, 1)
    assert load_config(None, ["train.max_steps=null"]).train.max_steps is None


@pytest.mark.parametrize("recipe", sorted(p.stem for p in RECIPES_DIR.glob("*.yaml")))
def test_shipped_recipes_load(recipe):
    config = load_config(recipe)
    assert config.train.log_every >= 1 and 1 <= config.eval.tree_nodes <= 64


def test_progress_bar_shows_small_learning_rates():
    shown = trainer_module.progress_postfix({"step": 3, "lr": 2e-4, "heads_loss": 1.23456, "targets": 7})
    assert shown == {"lr": "2.0e-04", "heads_loss": 1.235, "targets": 7}


def test_integer_settings_take_what_yaml_gives():
    config = load_config(None, ["data.self_prompts=1.2e4", "train.epochs=2.0", "seed=123456789012345678"])
    assert (config.data.self_prompts, config.train.epochs, config.seed) == (12000, 2, 123456789012345678)


def test_heads_can_start_from_trained_ones(tmp_path):
    """heads.init_from (Medusa-2 after Medusa-1): the weights come in, and training starts from their loss."""
    trained = make_trainer(tmp_path / "a", "train.epochs=20", "train.save_every=0")
    trained_state = trained.train()
    trained.unwrapped_heads().save_pretrained(tmp_path / "heads")
    again = make_trainer(tmp_path / "b", f"heads.init_from={tmp_path / 'heads'}", "train.epochs=1",
                         "train.save_every=0")
    mine, theirs = again.unwrapped_heads().state_dict(), trained.unwrapped_heads().state_dict()
    assert all(torch.equal(mine[k], theirs[k].float()) for k in theirs)
    fresh_first = losses(make_trainer(tmp_path / "c", "train.epochs=1", "train.save_every=0").train())[1]
    assert losses(again.train())[1] < 0.8 * fresh_first
    assert losses(again.state)[1] <= 1.2 * losses(trained_state)[max(losses(trained_state))]


def test_init_from_heads_of_another_shape_is_refused(tmp_path):
    make_trainer(tmp_path / "a").unwrapped_heads().save_pretrained(tmp_path / "heads")
    with pytest.raises(ValueError, match="num_layers is 1, but this run's heads.num_layers is 2"):
        make_trainer(tmp_path / "b", f"heads.init_from={tmp_path / 'heads'}", "heads.num_layers=2")


def test_init_from_shipped_is_refused_for_another_model(tmp_path):
    with pytest.raises(ValueError, match="init_from=shipped: the shipped heads are for the default model"):
        make_trainer(tmp_path, "heads.init_from=shipped", "model=some/other-model")


def test_soft_targets_train_the_heads_too(tmp_path):
    """Half the loss against the (near-uniform) random base's distribution: the heads still learn the rule."""
    state = make_trainer(tmp_path, "train.epochs=20", "train.save_every=0", "train.soft_targets=0.5").train()
    first, last = state.history[0], state.history[-1]
    assert last["heads_loss"] < first["heads_loss"] and last["top1_0"] > 0.6 > first["top1_0"]


def paired_data(n=64):
    """Random tokens a, each followed by a + 5: at a pair's end, the token after next is readable only
    from the next token (the root), never from the hidden state alone."""
    g = torch.Generator().manual_seed(1)
    seqs = []
    for _ in range(n):
        firsts = torch.randint(48, (10,), generator=g).tolist()
        seqs.append([1, 2, 3, 4] + [t for a in firsts for t in (a, (a + 5) % 48)])
    return Sequences.from_lists(seqs, [4] * n)


def final_top1(tmp_path, data, head: int, *overrides) -> float:
    """Head `head`'s top-1 accuracy over the last 10 steps of 30 epochs on `data`."""
    config = load_config(None, [f"output_dir={tmp_path}", "train.max_tokens_per_batch=512", "train.log_every=1",
                                "train.lr=2e-2", "train.epochs=30", "train.save_every=0", *overrides])
    history = Trainer(config, tiny_base(), data).train().history
    return sum(m[f"top1_{head}"] for m in history[-10:]) / 10


@pytest.mark.parametrize("rooted", [True, False])
def test_heads_that_read_the_root_learn_what_plain_heads_cannot(tmp_path, rooted):
    # one head with top-10 ranks can fill a tree of at most 11 nodes (the config refuses the default 64)
    top1 = final_top1(tmp_path, paired_data(), 0, "heads.num_heads=1", "eval.tree_nodes=11",
                      f"heads.condition_on_root={str(rooted).lower()}")
    # head 0 can be right at every pair's end (half the positions) only when it sees the root
    assert top1 > 0.4 if rooted else top1 < 0.15


def test_plain_heads_can_start_root_conditioned_ones_not_the_reverse(tmp_path):
    make_trainer(tmp_path / "a", "heads.condition_on_root=false").unwrapped_heads().save_pretrained(tmp_path / "p")
    rooted = make_trainer(tmp_path / "b", f"heads.init_from={tmp_path / 'p'}")
    assert rooted.unwrapped_heads().config.condition_on_root
    assert not rooted.unwrapped_heads().root_proj.any()  # starts as the plain heads
    rooted.unwrapped_heads().save_pretrained(tmp_path / "r")
    with pytest.raises(ValueError, match="condition_on_root=true"):
        make_trainer(tmp_path / "c", f"heads.init_from={tmp_path / 'r'}", "heads.condition_on_root=false")


def triple_data(n=128):
    """Triples (a, b, b + 5) of random a, b: at a triple's end, the token three ahead (b' + 5) is
    readable only from the token two ahead (b'), which the second head reads only from the chain."""
    g = torch.Generator().manual_seed(2)
    seqs = []
    for _ in range(n):
        pairs = torch.randint(48, (8, 2), generator=g).tolist()
        seqs.append([1, 2, 3, 4] + [t for a, b in pairs for t in (a, b, (b + 5) % 48)])
    return Sequences.from_lists(seqs, [4] * n)


@pytest.mark.parametrize("chained", [True, False])
def test_chained_heads_learn_from_the_chain(tmp_path, chained):
    top1 = final_top1(tmp_path, triple_data(), 1, "heads.num_heads=2",
                      f"heads.condition_on_chain={str(chained).lower()}")
    # head 1 can be right at every triple's end (a third of the positions) only when it reads the chain
    assert top1 > 0.28 if chained else top1 < 0.15


def test_resume_without_a_checkpoint_fails_before_loading_or_distilling(tmp_path, monkeypatch):
    from medusa.training import pipeline

    monkeypatch.setattr(pipeline, "load_base", lambda *a, **k: pytest.fail("loaded the model before the check"))
    config = load_config(None, [f"output_dir={tmp_path / 'run'}"])
    with pytest.raises(FileNotFoundError, match=r"--resume: no checkpoint under .*run/checkpoints \(check output_dir"):
        pipeline.run_training(config, resume=True)


def test_an_empty_split_stops_the_run_before_training():
    from medusa.training import pipeline

    config = load_config(None, ["data.holdout_fraction=0.03"])
    some, none = Sequences.from_lists([[1, 2, 3]], [1]), Sequences.from_lists([], [])
    pipeline.check_splits(some, some, config)
    for train, heldout, name in ((some, none, "held-out"), (none, some, "train")):
        with pytest.raises(ValueError, match=rf"the {name} split is empty \(.*holdout_fraction=0.03\)"):
            pipeline.check_splits(train, heldout, config)
