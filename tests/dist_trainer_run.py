"""Launched by tests/test_distributed.py: a few real MultiTurnGRPOTrainer steps on 2 CPU processes.

Rank 0 gets questions whose prompts ask for more, so ranks hold different numbers of tokens and the
per-step datums (after dropping zero-advantage groups) differ across ranks. Rank 0 writes a report.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
import time
from pathlib import Path

import torch
from transformers import TrainerCallback

sys.path.insert(0, str(Path(__file__).parent))

from support.trainer import TokenReward  # noqa: E402
from trl_plugins.tiny import build_tiny_model, build_tokenizer  # noqa: E402
from trl_plugins.trainers import MultiTurnGRPOConfig, MultiTurnGRPOTrainer, TrainingInterrupted  # noqa: E402


class SlotReward(TokenReward):
    """TokenReward, but constant for the questions without "Explain" (zero-advantage groups), so the
    ranks keep different numbers of datums."""

    def __call__(self, trajectory, example) -> float:
        if "Explain" not in example["prompt"]:
            return 1.0
        return super().__call__(trajectory, example)


def mark(folder: str, name: str) -> None:
    Path(folder).mkdir(parents=True, exist_ok=True)
    (Path(folder) / name).touch()


class Probe(TrainerCallback):
    """Markers before each update, an optional slow update, and per-rank trajectory dumps."""

    def __init__(self, trainer, args, rank: int) -> None:
        self.trainer, self.args, self.rank = trainer, args, rank

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.args.markers:
            mark(self.args.markers, f"update-step{state.global_step + 1}-rank{self.rank}")
        if self.args.slow_update:
            time.sleep(self.args.slow_update)

    def on_step_end(self, args, state, control, **kwargs):
        if self.args.reward_model:  # each trajectory, scored with the reward model on this rank, and its row
            batch = self.trainer.last_batch
            folder = Path(self.args.output_dir) / "reward-model-dump"
            folder.mkdir(parents=True, exist_ok=True)
            scored = [(t, batch.rows[t.group_id]) for t in batch.trajectories]
            (folder / f"rank{self.rank}-step{state.global_step}.pkl").write_bytes(pickle.dumps(scored))
        if not self.args.dump:
            return
        trajs = self.trainer.last_batch.trajectories
        record = {
            "step": state.global_step,
            "trajectories": [
                {
                    "stop": t.stop_reason.value,
                    "reward": t.reward,
                    "tokens": t.num_tokens,
                    "world_failure": t.world_failure,
                    "components": {c.name: c.value for c in t.reward_components},
                }
                for t in trajs
            ],
        }
        Path(self.args.dump).mkdir(parents=True, exist_ok=True)
        with open(Path(self.args.dump) / f"rank{self.rank}.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--output_dir", required=True)
    ap.add_argument("--max_steps", type=int, default=3)
    ap.add_argument("--save_steps", type=int, default=0, help="checkpoint every N steps (0: never)")
    ap.add_argument("--resume", default=None, help="checkpoint to resume from")
    ap.add_argument("--params_out", default=None, help="write the final full parameters here (rank 0)")
    ap.add_argument("--per_device", type=int, default=4)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--optim", default="adamw_torch")
    ap.add_argument("--slot_reward", action="store_true", help="reward that is constant for one question")
    ap.add_argument("--per_row_seed", action="store_true", help="sample each row on its own (world-size independent)")
    ap.add_argument("--beta", type=float, default=0.0, help="reference KL in the loss (TRL builds the reference)")
    ap.add_argument(
        "--teacher",
        action="store_true",
        help="on-policy distillation from a tiny teacher (other seed), with the reward: advantage 'opd'",
    )
    ap.add_argument(
        "--flaky",
        action="store_true",
        help="a scripted tool-calling policy, a flaky tool and a verifier "
        "that raises on some answers and hangs on others (infrastructure failures)",
    )
    ap.add_argument("--lora", action="store_true", help="train a LoRA adapter on q_proj and v_proj (peft_config)")
    ap.add_argument("--initial_out", default=None, help="write the full parameters before training here (rank 0)")
    ap.add_argument(
        "--padding_free", action="store_true", help="padding-free micro-batches (the default is auto: off for sdpa)"
    )
    ap.add_argument(
        "--dynamic_sampling",
        type=float,
        default=0.0,
        help="DAPO dynamic sampling with this dynamic_sampling_max_groups (0: off)",
    )
    ap.add_argument(
        "--async_k", type=int, default=None, help="async_rollouts with this max_staleness (0: the synchronous loop)"
    )
    ap.add_argument(
        "--gae", action="store_true", help="actor-critic: advantage gae, the critic built from the saved policy"
    )
    ap.add_argument(
        "--slow_tool", action="store_true", help="a scripted policy whose calls sleep 1 s in the real sandbox"
    )
    ap.add_argument(
        "--markers",
        default=None,
        help="write <markers>/<what>-step<N>-rank<R> as the run reaches rollouts "
        "and updates (a test times its signals by them)",
    )
    ap.add_argument("--slow_update", type=float, default=0.0, help="sleep this long before each optimizer step")
    ap.add_argument(
        "--dump",
        default=None,
        help="each rank writes <dump>/rank<R>.jsonl: per step, its trajectories' "
        "stop reasons, rewards, token counts and world failures",
    )
    ap.add_argument(
        "--vllm",
        choices=["colocate", "server"],
        default=None,
        help="generate with the fake vLLM (tests/fake_vllm.py) through TRL's VLLMGeneration",
    )
    ap.add_argument("--vllm_url", default=None, help="server mode: the fake server's base URL")
    ap.add_argument(
        "--broken_world",
        action="store_true",
        help="every trajectory of rank 1 and one of rank 0 end "
        "environment_error (support.trainer:RankBrokenWorldRollout): over max_environment_error_rate",
    )
    ap.add_argument("--constant_reward", action="store_true", help="a reward of 1 for every trajectory: no update")
    ap.add_argument(
        "--reward_model",
        action="store_true",
        help="also score with the reward_model component (a tiny reward model, weight 0: the run is the same); each "
        "rank pickles its scored trajectories and their rows per step to <output_dir>/reward-model-dump/",
    )
    ap.add_argument(
        "--sequence_parallel",
        action="store_true",
        help="sequence_parallel_size=2 (DeepSpeed): each datum's tokens split over the two ranks in the update",
    )
    ap.add_argument(
        "--expect_stop",
        action="store_true",
        help="a RuntimeError out of train() (NoPolicyUpdate included) "
        "is the outcome: each rank's message goes into the report as 'stops', in rank order",
    )
    return ap.parse_args(argv)


def run(args: argparse.Namespace) -> None:
    """One trainer run as ``args`` describes; rank 0 writes its report to ``args.out``."""
    from datasets import Dataset

    deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    tok = build_tokenizer("qwen2_5")
    model = build_tiny_model(tok)
    if args.vllm:
        import fake_vllm as testing_vllm

        testing_vllm.install()
    if (args.beta and not args.lora) or args.gae or args.vllm:
        # TRL builds the reference from the policy's path; each rank writes its own identical copy (with LoRA
        # the reference is the policy with its adapter disabled: no copy). vLLM loads the policy by its path.
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            # A later case of a --cases launch: transformers saves on rank 0 only once a process group exists.
            path = Path(args.output_dir) / "policy"
            if dist.get_rank() == 0:
                model.save_pretrained(path)
                tok.save_pretrained(path)
            dist.barrier()
        else:
            path = Path(args.output_dir) / f"policy-{os.environ.get('LOCAL_RANK', '0')}"
            model.save_pretrained(path)
            tok.save_pretrained(path)
        model = str(path)
    teacher = None
    if args.teacher:
        # Each process saves the same seeded teacher (rank 0 only once a process group exists, as for the policy).
        import torch.distributed as dist

        teacher_model = build_tiny_model(tok, seed=1)
        shared = dist.is_available() and dist.is_initialized()
        teacher = Path(args.output_dir) / ("teacher" if shared else f"teacher-{os.environ.get('LOCAL_RANK', '0')}")
        if not shared or dist.get_rank() == 0:
            teacher_model.save_pretrained(teacher)
            tok.save_pretrained(teacher)
        if shared:
            dist.barrier()
    components, weights, component_kwargs = ["token"], None, None
    if args.reward_model:
        components, weights = ["token", "reward_model"], [1.0, 0.0]
        component_kwargs = {"reward_model": {"model": save_reward_model(args.output_dir), "batch_size": 3}}
    rows = [
        {"prompt": ("Explain in detail " * (i % 3)) + f"what {i} * {i} is.", "answer": str(i * i)} for i in range(16)
    ]
    config = MultiTurnGRPOConfig(
        output_dir=args.output_dir,
        per_device_train_batch_size=args.per_device,
        num_generations=2,
        max_steps=args.max_steps,
        report_to=[],
        save_strategy="steps" if args.save_steps else "no",
        save_steps=args.save_steps or 500,
        logging_steps=1,
        optim=args.optim,
        temperature=args.temperature,
        beta=args.beta,
        **({"advantage": "gae", "critic_learning_rate": 1e-2, "critic_optim": "sgd"} if args.gae else {}),
        **(
            {
                "rollout": "support.trainer:ScriptedToolRollout",
                "reward_time_limit_s": 0.5,
                "max_verifier_error_rate": 0.9,
                "max_environment_error_rate": 0.9,
            }
            if args.flaky
            else {}
        ),
        **({"rollout": "support.trainer:PerRowSeedRollout"} if args.per_row_seed else {}),
        **({"rollout": "support.trainer:SlowToolRollout"} if args.slow_tool else {}),
        **({"rollout": "support.trainer:RankBrokenWorldRollout"} if args.broken_world else {}),
        **(
            {"dynamic_sampling": True, "dynamic_sampling_max_groups": args.dynamic_sampling}
            if args.dynamic_sampling
            else {}
        ),
        **({"async_rollouts": True, "max_staleness": args.async_k} if args.async_k is not None else {}),
        learning_rate=5e-3,
        seed=0,
        disable_tqdm=True,
        **({"padding_free": True} if args.padding_free else {}),
        **({"teacher_model_name_or_path": str(teacher), "advantage": "opd"} if teacher is not None else {}),
        **({"sequence_parallel_size": 2} if args.sequence_parallel else {}),
        rollout_kwargs={"max_turns": 2, "max_assistant_tokens": 16, "max_trajectory_tokens": 700},
        reward_components=components,
        reward_component_weights=weights,
        reward_component_kwargs=component_kwargs,
        max_padded_tokens_per_micro_batch=2000,
        max_items_per_micro_batch=2,
        bf16=False,
        **({"ddp_backend": "gloo"} if deepspeed else {"use_cpu": True}),
        **({"use_vllm": True, "vllm_mode": args.vllm, "vllm_server_base_url": args.vllm_url} if args.vllm else {}),
    )
    reward = SlotReward() if args.slot_reward else TokenReward()
    if args.constant_reward:
        from support.trainer import ConstantReward

        reward = ConstantReward()
    extra = {}
    if args.flaky:
        from support.trainer import FlakyCodeTool, PickyVerifier

        reward, extra = PickyVerifier(), {"tools": {"code_interpreter": FlakyCodeTool()}}
    if args.lora:
        from peft import LoraConfig

        extra["peft_config"] = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
        torch.manual_seed(0)  # the adapter's random init (lora_A): the same on every rank and in every run
    trainer = MultiTurnGRPOTrainer(
        model,
        config,
        train_dataset=Dataset.from_list(rows),
        processing_class=tok,
        reward_components={"token": reward},
        **extra,
    )
    rank = trainer.accelerator.process_index
    if args.initial_out and trainer.accelerator.is_main_process:  # not yet prepared: full local parameters
        torch.save({k: v.detach().float().clone() for k, v in trainer.model.state_dict().items()}, args.initial_out)
    if args.markers or args.slow_update or args.dump or args.reward_model:
        trainer.add_callback(Probe(trainer, args, rank))
    if args.markers:
        inner = trainer._roll_out

        def marked(rows):
            mark(args.markers, f"rollout-step{trainer.state.global_step + 1}-rank{rank}")
            return inner(rows)

        trainer._roll_out = marked
    try:
        trainer.train(resume_from_checkpoint=args.resume)
    except TrainingInterrupted as stopped:
        print(f"INTERRUPTED rank={rank} step={stopped.step} checkpoint={stopped.checkpoint}", flush=True)
        sys.stdout.flush()
        os._exit(stopped.exit_code)
    except RuntimeError as stop:
        if not args.expect_stop:
            raise
        report_stop(trainer, args, stop)
        return
    vllm_match = None
    if args.vllm:
        trainer.generation_backend().sync_weights(trainer.state.global_step)  # a collective: every rank pushes
    state = trainer.accelerator.get_state_dict(trainer.model_wrapped)
    if args.vllm == "colocate" and trainer.accelerator.is_main_process:
        engine = dict(trainer.vllm_generation.llm.engine.model.named_parameters())
        vllm_match = all(torch.equal(engine[k], v.detach().float().cpu()) for k, v in state.items() if k in engine)
    if args.gae:
        from trl_plugins.trainers.critic import critic_state_dict

        state = {
            **(state or {}),
            **{f"critic.{k}": v for k, v in critic_state_dict(trainer.accelerator, trainer._critic).items()},
        }
    if trainer.accelerator.is_main_process and args.params_out:
        torch.save({k: v.detach().float().cpu() for k, v in state.items()}, args.params_out)
    if trainer.accelerator.is_main_process:
        checksum = float(sum(v.float().abs().sum() for v in state.values()))
        records = [json.loads(line) for line in (Path(args.output_dir) / "metrics.jsonl").read_text().splitlines()]
        Path(args.out).write_text(
            json.dumps(
                {
                    "world": trainer.accelerator.num_processes,
                    "deepspeed": deepspeed,
                    "vllm_weights_match": vllm_match,
                    "global_step": trainer.state.global_step,
                    "checksum": checksum,
                    "steps": [r for r in records if "train/update_skipped" in r],
                    # The weights digest of the last batch's trajectories (under ZeRO-3: taken in the rollout's own gather).
                    "weights_digests": sorted(
                        {str(t.policy_version.weights_digest) for t in trainer.last_batch.trajectories}
                    ),
                    "teacher_version": trainer.run.version.plugin_versions.get("teacher"),
                }
            )
        )
    trainer.accelerator.wait_for_everyone()


def save_reward_model(output_dir: str) -> str:
    """The tiny reward model of support.reward_model, the same on every rank (seeded), in a folder of this rank's
    (``reward-model-<local rank>``), or rank 0's once a process group exists (transformers saves on rank 0 only)."""
    import torch.distributed as dist

    from support.reward_model import save_reward_model as save

    if dist.is_available() and dist.is_initialized():
        path = Path(output_dir) / "reward-model-0"
        if dist.get_rank() == 0:
            save(path)
        dist.barrier()
        return str(path)
    return save(Path(output_dir) / f"reward-model-{os.environ.get('LOCAL_RANK', '0')}")


def report_stop(trainer, args: argparse.Namespace, stop: BaseException) -> None:
    """Every rank's stop message; rank 0 reports them in rank order (the process group is intact: the stop was raised
    on every rank at the same point, after the step's collectives)."""
    rank = trainer.accelerator.process_index
    Path(f"{args.out}.stop.rank{rank}").write_text(f"{type(stop).__name__}: {stop}")
    trainer.accelerator.wait_for_everyone()
    if trainer.accelerator.is_main_process:
        stops = [Path(f"{args.out}.stop.rank{r}").read_text() for r in range(trainer.accelerator.num_processes)]
        Path(args.out).write_text(
            json.dumps(
                {
                    "world": trainer.accelerator.num_processes,
                    "global_step": trainer.state.global_step,
                    "policy_updates": trainer.policy_updates,
                    "stops": stops,
                    "finished": getattr(stop, "finished", None),
                }
            )
        )
    trainer.accelerator.wait_for_everyone()


def main() -> None:
    """One run (the arguments above), or ``--cases FILE``: a JSON list of argument lists, run one after the other in
    this launch (the launch's start-up, some 10-15 s of imports per rank, is paid once). A case that fails writes
    ``<its --out>.error.rank<R>`` with the traceback and ends the launch (the other ranks are stopped by the
    launcher)."""
    if sys.argv[1:2] == ["--cases"]:
        cases = json.loads(Path(sys.argv[2]).read_text())
    else:
        cases = [sys.argv[1:]]
    # Every run's Trainer.train() starts with a full gc.collect(); what the trainer imports lives as long as the
    # process, so it is moved out of the collector's reach first (~0.2 s per run, as in tests/conftest.py).
    import gc

    import trl_plugins.trainers.multi_turn_trainer  # noqa: F401

    gc.collect()
    gc.freeze()
    for argv in cases:
        args = parse(argv)
        try:
            run(args)
        except BaseException:  # noqa: BLE001 - reported to the test, then the launch ends
            import traceback

            Path(f"{args.out}.error.rank{os.environ.get('RANK', '0')}").write_text(traceback.format_exc())
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
