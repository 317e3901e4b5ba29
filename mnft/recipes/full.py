"""Full fine-tuning: every parameter trained, sharded with FSDP2 (``fully_shard`` per block, then the root).

    torchrun --nnodes N --nproc-per-node G --node-rank I --master-addr HOST --master-port P \\
        -m mnft.recipes.full [config=PATH] key=value ...
    python -m mnft.recipes.full max_steps=20          # one process

Reads top to bottom: setup (process group, model, FSDP2 sharding with bf16 mixed precision on GPU, data,
optimizer, resume), the train loop (gradient accumulation with the loss normalised by the global count of
trained tokens, clipping, non-finite guard, metrics, checkpoints), the final export, cleanup. FSDP2 runs on
NCCL/GPU and on gloo/CPU alike. Config keys: configs/full.yaml and docs/recipes.md.
"""

from __future__ import annotations

import collections
import math
import time

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from mnft.recipes import checkpointing, common, data, metrics, model, timing
from mnft.recipes import dist as mdist
from mnft.recipes.config import FullConfig, RecipeError

RECIPE = "full"


def train(cfg: FullConfig, d: mdist.Dist) -> None:
    # ---------------------------------------------------------------- setup
    out = common.output_dir(cfg, RECIPE, d)
    mdist.seed_all(cfg.seed)
    model_dir = model.resolve(cfg.model, cfg.model_cache_dir, d)
    net, tokenizer = model.load(model_dir, model.dtype_for(cfg.model_dtype, d, frozen_base=False))
    model.check_same_weights(net, d)
    if cfg.activation_checkpointing:
        net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    bf16 = cfg.mixed_precision == "bf16" or (cfg.mixed_precision == "auto" and d.device.type == "cuda")
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    fsdp_kwargs = {"reshard_after_forward": cfg.reshard_after_forward, **({"mp_policy": mp} if mp else {})}
    blocks = getattr(getattr(net, "model", None), "layers", None)
    if blocks is None:
        raise RecipeError(f"model {model_dir}: no .model.layers to shard (a decoder-only HF causal LM is expected)")
    for block in blocks:
        fully_shard(block, **fsdp_kwargs)
    fully_shard(net, **fsdp_kwargs)  # the root: embeddings, final norm, lm_head
    net.to(d.device)
    n_total = sum(p.numel() for p in net.parameters())  # sharded: this rank's share
    mdist.seed_all(cfg.seed + d.rank)

    rows = data.build(tokenizer, cfg.data_path, cfg.max_seq_len, cfg.packing)
    batches = data.Batches(rows, cfg.micro_batch_size, d.rank, d.world_size, cfg.seed, tokenizer.pad_token_id)
    optimizer = torch.optim.AdamW(net.parameters(), lr=cfg.lr, betas=tuple(cfg.adam_betas),
                                  weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, common.CosineWithWarmup(cfg.warmup_steps, cfg.max_steps, cfg.min_lr_ratio))

    def checkpoint_state() -> dict:  # this rank's shards of model and optimizer (DTensors), everything else
        model_sd, optim_sd = get_state_dict(net, optimizer)
        return {"model": model_sd, "optim": optim_sd, "scheduler": scheduler.state_dict(),
                "data": batches.position(), "rng": mdist.rng_state()}

    global_batch = cfg.micro_batch_size * cfg.grad_accum_steps * d.world_size
    ckpt_root = out / "checkpoints"
    resume_from = checkpointing.resolve(cfg.resume, ckpt_root, d.rank, d.world_size, cfg.overwrite)
    step, skipped, history = 0, 0, {"initial_loss": None, "recent": []}
    if resume_from is not None:
        state = checkpoint_state()
        meta = checkpointing.load(resume_from, state, d.rank)
        set_state_dict(net, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        scheduler.load_state_dict(state["scheduler"])
        batches.seek(state["data"])
        mdist.set_rng_state(resume_from.rng_state(state["rng"], d.rank))  # a rank new to the run: derived
        step, skipped, history = meta["step"], meta["skipped_steps"], meta["history"]
    log = metrics.Metrics(out, d.is_main, cfg.max_steps, cfg.tensorboard, resumed=resume_from is not None)
    timer = timing.StepTimer(out, d.rank, d.node_rank, d.local_rank, resumed=resume_from is not None)  # every rank
    timer.start_info(d.world_size, d.device)
    if d.is_main:
        where = f"resuming from {resume_from}" if resume_from else "starting at step 0"
        print(f"full: {n_total:,} parameters on rank 0 (FSDP2 shards), {len(rows)} rows, world {d.world_size}, "
              f"{'bf16' if bf16 else 'fp32'}, {where}, output {out}", flush=True)
        log.event("start", recipe=RECIPE, resumed_from_step=step, world_size=d.world_size)
        if resume_from is not None:
            checkpointing.announce(resume_from, meta, global_batch, batches.position(), log)

    # ---------------------------------------------------------------- train loop
    recent = collections.deque(history["recent"], maxlen=5)
    consecutive_bad, tokens_total, time_total, t_start = 0, 0, 0.0, time.time()
    net.train()
    save_request = common.SaveRequest()  # MNFT_SAVE_SIGNAL (Slurm's warning before the time limit): save, stop
    while step < cfg.max_steps:
        step += 1
        t0 = time.perf_counter()
        timer.begin()
        with timer.data():
            micro = [batches.next() for _ in range(cfg.grad_accum_steps)]
        local_tokens = sum(data.trained_tokens(b) for b in micro)
        with timer.comm():
            (global_tokens,) = mdist.all_reduce([local_tokens], d.device)
        denom = max(global_tokens, 1.0)  # no trained token anywhere: loss 0, grads 0, never 0/0
        loss_sum = torch.zeros((), device=d.device)
        for i, b in enumerate(micro):
            net.set_requires_gradient_sync(i == len(micro) - 1)  # reduce-scatter once per step
            with common.autocast(d, "fp32" if bf16 else cfg.mixed_precision):  # FSDP2 casts params itself
                logits = net(input_ids=b["input_ids"].to(d.device),
                             attention_mask=b["attention_mask"].to(d.device)).logits
            s = common.token_loss_sum(logits, b["labels"])
            if step in cfg.debug_nan_steps and d.rank == d.world_size - 1:  # one rank only: all must skip
                s = s * float("nan")
            # FSDP2 averages gradients over ranks, hence * world_size: the sum over all ranks / global tokens
            (s * d.world_size / denom).backward()
            loss_sum += s.detach()
        if step in cfg.debug_inf_grad_steps and d.rank == d.world_size - 1:  # finite loss, inf grad
            common.poison_grad(list(net.parameters()))
        grad_norm = torch.nn.utils.clip_grad_norm_(net.parameters(), cfg.max_grad_norm)
        grad_norm = grad_norm.full_tensor().item() if hasattr(grad_norm, "full_tensor") else grad_norm.item()
        flags = [loss_sum.item(), float(not math.isfinite(grad_norm)), float(save_request.requested)]
        with timer.comm():  # a save asked of any rank (its signal) is every rank's, at this step
            total_loss, any_bad, save_now = mdist.all_reduce(flags, d.device)
        loss = total_loss / denom
        if global_tokens == 0:
            pass  # nothing to learn from: no update (AdamW would still move weights by momentum/decay)
        elif any_bad or not math.isfinite(loss):
            skipped, consecutive_bad = skipped + 1, consecutive_bad + 1
        else:
            optimizer.step()
            consecutive_bad = 0
        optimizer.zero_grad(set_to_none=True)
        lr = scheduler.get_last_lr()[0]
        scheduler.step()
        dt = time.perf_counter() - t0
        figures = timer.end()
        tokens_total, time_total = tokens_total + global_tokens, time_total + dt
        ok = global_tokens > 0 and math.isfinite(loss) and not any_bad
        if ok:
            history["initial_loss"] = history["initial_loss"] if history["initial_loss"] is not None else loss
            recent.append(loss)
        show = step % cfg.log_every == 0 or step == cfg.max_steps or not ok  # progress line; JSONL every step
        checks = {"rank_checksums": common.rank_checksums(list(net.parameters()))} if cfg.debug_rank_checksums else {}
        checks |= {"sample_ids": common.sample_ids(micro)} if cfg.debug_sample_ids else {}
        log.step(step, loss, lr, grad_norm, global_tokens / dt, int(global_tokens), skipped,
                 metrics.peak_memory_mb(d.device), show=show, skipped=not ok and global_tokens > 0, **checks, **figures)
        if consecutive_bad >= cfg.max_consecutive_skips:
            raise RecipeError(
                f"{consecutive_bad} steps in a row had a non-finite loss or grad norm (last at step {step}: "
                f"loss={loss}, grad_norm={grad_norm}); lower lr, raise warmup_steps, check the data, "
                "or use fp32 (mixed_precision=fp32)")

        # ------------------------------------------------------------ checkpoint
        ckpt_start = time.perf_counter()
        saving = bool(cfg.save_every and step % cfg.save_every == 0) or bool(save_now)
        if saving:
            history["recent"] = list(recent)
            checkpointing.save(ckpt_root, step, checkpoint_state(),
                               {"skipped_steps": skipped, "history": history, "recipe": RECIPE,
                                "global_batch": global_batch},
                               d.rank, d.world_size, cfg.keep_last)
            if d.is_main:
                print(f"checkpoint step-{step} complete", flush=True)
                log.event("checkpoint", step=step, path=str(checkpointing.step_dir(ckpt_root, step)))
        timer.write(step, figures, time.perf_counter() - ckpt_start if saving else 0.0)
        if step == cfg.debug_crash_after_step:
            common.crash_now(step)
        if save_now and step < cfg.max_steps:  # saved on the signal: stop here, a resume continues from this step
            common.stop_after_save(step, d.is_main, log, timer, save_request.name)
            return

    # ---------------------------------------------------------------- export and cleanup
    final_loss = sum(recent) / len(recent) if recent else None
    log.summary(history["initial_loss"], final_loss, tokens_total / max(time_total, 1e-9), step, skipped,
                time.time() - t_start)
    if cfg.save_final:  # gather full weights (collective), rank 0 writes a from_pretrained-loadable model
        full_sd = get_model_state_dict(net, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if d.is_main:
            net.save_pretrained(out / "model", state_dict=full_sd)
            tokenizer.save_pretrained(out / "model")
            print(f"saved model to {out / 'model'}", flush=True)
            log.event("saved", model=str(out / "model"))
    log.close()
    timer.close()
    dist.barrier()


def main(argv: list[str] | None = None) -> int:
    return common.run(RECIPE, train, argv)


if __name__ == "__main__":
    raise SystemExit(main())
