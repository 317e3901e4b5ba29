"""LoRA fine-tuning: frozen base, PEFT adapters trained data-parallel (DDP), adapters saved in PEFT format.

    torchrun --nnodes N --nproc-per-node G --node-rank I --master-addr HOST --master-port P \\
        -m mnft.recipes.lora [config=PATH] key=value ...
    python -m mnft.recipes.lora max_steps=20          # one process

Reads top to bottom: setup (process group, model, adapters, data, optimizer, resume), the train loop (gradient
accumulation with the loss normalised by the global count of trained tokens, clipping, non-finite guard,
metrics, checkpoints), the final export, cleanup. Config keys: configs/lora.yaml and docs/recipes.md.
"""

from __future__ import annotations

import collections
import math
import time
from contextlib import nullcontext

import peft
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP

from mnft.recipes import checkpointing, common, data, metrics, model, timing
from mnft.recipes import dist as mdist
from mnft.recipes.config import LoraConfig, RecipeError

RECIPE = "lora"


def train(cfg: LoraConfig, d: mdist.Dist) -> None:
    # ---------------------------------------------------------------- setup
    out = common.output_dir(cfg, RECIPE, d)
    mdist.seed_all(cfg.seed)  # the same on every rank: identical adapter initialisation
    model_dir = model.resolve(cfg.model, cfg.model_cache_dir, d)
    base, tokenizer = model.load(model_dir, model.dtype_for(cfg.model_dtype, d, frozen_base=True))
    model.check_same_weights(base, d)
    if cfg.activation_checkpointing:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lora = peft.LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                           target_modules=list(cfg.lora_target_modules), task_type="CAUSAL_LM")
    try:
        peft_model = peft.get_peft_model(base, lora)
    except ValueError as e:  # e.g. a target module that this architecture does not have
        raise RecipeError(f"config key 'lora_target_modules': {str(e).splitlines()[0]}") from None
    for p in peft_model.parameters():  # adapters train in fp32 even over a bf16 base
        if p.requires_grad:
            p.data = p.data.float()
    peft_model.to(d.device)
    # DDP only where there is something to average: in a world of one its hooks are pure overhead
    ddp = DDP(peft_model, device_ids=[d.device.index] if d.device.type == "cuda" else None) if d.world_size > 1 else peft_model
    trainable = [p for p in ddp.parameters() if p.requires_grad]
    n_train, n_total = sum(p.numel() for p in trainable), sum(p.numel() for p in ddp.parameters())
    mdist.seed_all(cfg.seed + d.rank)  # per-rank from here on (dropout)

    rows = data.build(tokenizer, cfg.data_path, cfg.max_seq_len, cfg.packing)
    batches = data.Batches(rows, cfg.micro_batch_size, d.rank, d.world_size, cfg.seed, tokenizer.pad_token_id)
    optimizer = torch.optim.AdamW(trainable, lr=cfg.lr, betas=tuple(cfg.adam_betas), weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, common.CosineWithWarmup(cfg.warmup_steps, cfg.max_steps, cfg.min_lr_ratio))

    # adapters only; the frozen base comes from model_dir (strict=False: frozen keys are absent on load, and
    # dcp.load already fails if an adapter key is missing from the checkpoint)
    adapters_only = StateDictOptions(ignore_frozen_params=True, strict=False)

    def checkpoint_state() -> dict:  # adapters only (frozen base excluded), optimizer, everything else
        model_sd, optim_sd = get_state_dict(ddp, optimizer, options=adapters_only)
        return {"model": model_sd, "optim": optim_sd, "scheduler": scheduler.state_dict(),
                "data": batches.position(), "rng": mdist.rng_state()}

    global_batch = cfg.micro_batch_size * cfg.grad_accum_steps * d.world_size
    ckpt_root = out / "checkpoints"
    resume_from = checkpointing.resolve(cfg.resume, ckpt_root, d.rank, d.world_size, cfg.overwrite,
                                         replicated=True)  # DDP: every rank dir holds all adapters
    step, skipped, history = 0, 0, {"initial_loss": None, "recent": []}
    if resume_from is not None:
        state = checkpoint_state()
        meta = checkpointing.load(resume_from, state, d.rank)
        set_state_dict(ddp, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=adapters_only)
        scheduler.load_state_dict(state["scheduler"])
        batches.seek(state["data"])
        mdist.set_rng_state(resume_from.rng_state(state["rng"], d.rank))  # a rank new to the run: derived
        step, skipped, history = meta["step"], meta["skipped_steps"], meta["history"]
    log = metrics.Metrics(out, d.is_main, cfg.max_steps, cfg.tensorboard, resumed=resume_from is not None)
    timer = timing.StepTimer(out, d.rank, d.node_rank, d.local_rank, resumed=resume_from is not None)  # every rank
    timer.start_info(d.world_size, d.device)
    if isinstance(ddp, DDP):
        ddp.register_comm_hook(None, timer.ddp_hook())  # the default all-reduce, timed
    if d.is_main:
        where = f"resuming from {resume_from}" if resume_from else "starting at step 0"
        print(f"lora: {n_train:,} trainable / {n_total:,} parameters, {len(rows)} rows, world {d.world_size}, "
              f"{where}, output {out}", flush=True)
        log.event("start", recipe=RECIPE, resumed_from_step=step, world_size=d.world_size,
                  trainable_params=n_train, total_params=n_total)
        if resume_from is not None:
            checkpointing.announce(resume_from, meta, global_batch, batches.position(), log)

    # ---------------------------------------------------------------- train loop
    recent = collections.deque(history["recent"], maxlen=5)
    consecutive_bad, tokens_total, time_total, t_start = 0, 0, 0.0, time.time()
    ddp.train()
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
            last = i == len(micro) - 1
            sync = ddp.no_sync() if not last and isinstance(ddp, DDP) else nullcontext()  # all-reduce once per step
            with sync:
                with common.autocast(d, cfg.mixed_precision):
                    logits = ddp(input_ids=b["input_ids"].to(d.device),
                                 attention_mask=b["attention_mask"].to(d.device)).logits
                s = common.token_loss_sum(logits, b["labels"])
                if step in cfg.debug_nan_steps and d.rank == d.world_size - 1:  # one rank only: all must skip
                    s = s * float("nan")
                # DDP averages gradients over ranks, hence * world_size: the sum over all ranks / global tokens
                with timer.synced_backward() if last and isinstance(ddp, DDP) else nullcontext():
                    (s * d.world_size / denom).backward()
            loss_sum += s.detach()
        if step in cfg.debug_inf_grad_steps and d.rank == d.world_size - 1:  # finite loss, inf grad
            common.poison_grad(trainable)
        grad_norm = torch.nn.utils.clip_grad_norm_(trainable, cfg.max_grad_norm).item()
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
        checks = {"rank_checksums": common.rank_checksums(trainable)} if cfg.debug_rank_checksums else {}
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
    if cfg.save_final and d.is_main:
        peft_model.save_pretrained(out / "adapter", save_embedding_layers=False)  # adapter_config.json + adapter_model.safetensors
        tokenizer.save_pretrained(out / "adapter")
        if cfg.export_merged:
            merged = peft_model.merge_and_unload()
            merged.save_pretrained(out / "merged")
            tokenizer.save_pretrained(out / "merged")
        print(f"saved adapters to {out / 'adapter'}" + (f" and merged model to {out / 'merged'}"
                                                         if cfg.export_merged else ""), flush=True)
        log.event("saved", adapter=str(out / "adapter"), merged=str(out / "merged") if cfg.export_merged else None)
    log.close()
    timer.close()
    dist.barrier()


def main(argv: list[str] | None = None) -> int:
    return common.run(RECIPE, train, argv)


if __name__ == "__main__":
    raise SystemExit(main())
