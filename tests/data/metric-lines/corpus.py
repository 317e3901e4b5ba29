"""What training scripts print, line by line, with what the `auto` metrics format must read from each (None: not a
step record). Each line is named by its source: the project and the file whose print or logger call wrote it (the
format string quoted), with made-up numbers. Read by tests/test_scrape.py."""

# (source, line as the script prints it, expected record or None)
CORPUS = [
    # the report of issue 36: a plain script's own print
    ("issue 36 steps.py: print(f'step {step} loss {loss:.4f}')",
     "step 21 loss 0.2474", {"step": 21, "loss": 0.2474}),
    ("issue 36 steps.py, its checkpoint line: print(f'checkpoint step-{step} complete')",
     "checkpoint step-200 complete", None),
    # karpathy/nanoGPT train.py
    ("karpathy/nanoGPT train.py: print(f\"iter {iter_num}: loss {lossf:.4f}, time {dt*1000:.2f}ms, mfu {running_mfu*100:.2f}%\")",
     "iter 100: loss 2.3456, time 12.34ms, mfu 1.23%", {"step": 100, "loss": 2.3456, "time_ms": 12.34, "mfu": 1.23}),
    ("karpathy/nanoGPT train.py, before the first mfu estimate: mfu -100.00%",
     "iter 0: loss 10.9856, time 5032.11ms, mfu -100.00%", {"step": 0, "loss": 10.9856, "time_ms": 5032.11, "mfu": -100.0}),
    ("karpathy/nanoGPT train.py: print(f\"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}\")",
     "step 250: train loss 1.9869, val loss 2.0853", {"step": 250, "loss": 1.9869, "val_loss": 2.0853}),
    ("karpathy/nanoGPT train.py: print(f\"saving checkpoint to {out_dir}\")",
     "saving checkpoint to out-shakespeare-char", None),
    # pytorch/examples
    ("pytorch/examples mnist/main.py: 'Train Epoch: {} [{}/{} ({:.0f}%)]\\tLoss: {:.6f}'",
     "Train Epoch: 1 [640/60000 (1%)]\tLoss: 1.846094", {"step": None, "epoch": 1.0, "loss": 1.846094}),
    ("pytorch/examples mnist/main.py: '\\nTest set: Average loss: {:.4f}, Accuracy: {}/{} ({:.0f}%)\\n'",
     "Test set: Average loss: 0.0274, Accuracy: 9910/10000 (99%)", None),
    ("pytorch/examples distributed/ddp-tutorial-series/multigpu.py: f\"[GPU{self.gpu_id}] Epoch {epoch} | Batchsize: {b_sz} | Steps: {len(self.train_data)}\"",
     "[GPU0] Epoch 3 | Batchsize: 32 | Steps: 32", None),
    ("pytorch/examples distributed/ddp-tutorial-series/multigpu.py: f\"Epoch {epoch} | Training checkpoint saved at {self.save_path}\"",
     "Epoch 10 | Training checkpoint saved at checkpoint.pt", None),
    ("pytorch/examples distributed/minGPT-ddp/mingpt/trainer.py: f\"[GPU{self.global_rank}] Epoch {epoch} | Iter {iter} | {step_type} Loss {batch_loss:.5f}\"",
     "[GPU0] Epoch 0 | Iter 100 | Train Loss 2.46870", {"step": 100, "epoch": 0.0, "loss": 2.4687}),
    ("pytorch/examples distributed/minGPT-ddp/mingpt/trainer.py, its evaluation: step_type Eval",
     "[GPU0] Epoch 0 | Iter 0 | Eval Loss 2.51230", None),
    # yunjey/pytorch-tutorial (the common hand-written form)
    ("yunjey/pytorch-tutorial tutorials/01-basics/feedforward_neural_network/main.py: 'Epoch [{}/{}], Step [{}/{}], Loss: {:.4f}'",
     "Epoch [1/5], Step [100/600], Loss: 0.3587", {"step": 100, "epoch": 1.0, "loss": 0.3587}),
    ("issue 36: a script's own 'Epoch {epoch} Step {step} Loss {loss}'",
     "Epoch 1 Step 20 Loss 0.5", {"step": 20, "epoch": 1.0, "loss": 0.5}),
    # tqdm: pbar.set_postfix(loss=...) (tqdm/std.py set_postfix: key=value after the rate)
    ("tqdm set_postfix(loss=loss.item()): the bar's postfix",
     "100%|██████████| 50/50 [00:02<00:00, 21.33it/s, loss=0.0512]", {"step": 50, "loss": 0.0512}),
    ("tqdm set_postfix(loss=…), the bar rewriting its line with \\r",
     " 10%|█         | 5/50 [00:00<00:02, 21.1it/s, loss=0.912]\r 12%|█▏        | 6/50 [00:00<00:02, 21.2it/s, loss=0.871]",
     {"step": 6, "loss": 0.871}),
    ("tqdm set_postfix(loss=…, lr=…) with a description: tqdm(desc='train')",
     "train:  40%|████      | 40/100 [00:10<00:15,  3.98it/s, loss=1.23, lr=0.0003]", {"step": 40, "loss": 1.23, "lr": 0.0003}),
    # Lightning: TQDMProgressBar (lightning/pytorch/callbacks/progress/tqdm_progress.py), metrics from self.log(..., prog_bar=True)
    ("Lightning TQDMProgressBar, self.log('train_loss', loss, prog_bar=True): epoch 0",
     "Epoch 0:  45%|████▌     | 45/100 [00:01<00:02, 30.12it/s, v_num=0, train_loss=0.123]", {"step": 45, "epoch": 0.0, "loss": 0.123, "v_num": 0.0}),
    ("Lightning TQDMProgressBar, on_step and on_epoch: train_loss_step and train_loss_epoch; epoch 1 of 100 batches",
     "Epoch 1:  40%|████      | 40/100 [00:00<00:00, 150.08it/s, v_num=1, train_loss_step=0.0123, train_loss_epoch=0.0456]",
     {"step": 140, "epoch": 1.0, "loss": 0.0123, "v_num": 1.0, "train_loss_epoch": 0.0456}),
    ("Lightning TQDMProgressBar: its validation bar",
     "Validation DataLoader 0: 100%|██████████| 10/10 [00:00<00:00, 80.00it/s]", None),
    # Hugging Face
    ("transformers trainer.py (ProgressCallback.on_log prints the logs dict)",
     "{'loss': 2.3145, 'grad_norm': 1.873, 'learning_rate': 4.9e-05, 'epoch': 0.01}",
     {"step": None, "loss": 2.3145, "grad_norm": 1.873, "lr": 4.9e-05, "epoch": 0.01}),
    ("transformers trainer.py: the evaluation's dict",
     "{'eval_loss': 1.2, 'eval_runtime': 0.5, 'eval_samples_per_second': 200.0, 'epoch': 1.0}", None),
    ("accelerate examples/nlp_example.py: accelerator.print(f\"epoch {epoch}:\", eval_metric)",
     "epoch 0: {'accuracy': 0.7230392156862745, 'f1': 0.8254545454545454}", None),
    ("accelerate examples/complete_cv_example.py: accelerator.print(f\"epoch {epoch}: {100 * eval_metric:.2f}\")",
     "epoch 2: 86.15", None),
    ("accelerate examples/by_feature/checkpointing.py: accelerator.save_state(output_dir) logs",
     "Saving current state to epoch_0", None),
    # torchtitan train.py (logger with colours; thousands with commas)
    ("pytorch/torchtitan train.py: f\"{color.red}step: {step:2}  {color.green}loss: {loss:7.4f}  … tps: {round(tps):,} … mfu: {mfu:.2f}%\"",
     "[rank0]:[titan] 2025-01-01 12:00:00,123 - root - INFO - \x1b[31mstep: 10  \x1b[32mloss:  8.1234  \x1b[33mmemory: 35.12GiB(37.00%)  "
     "\x1b[34mtps: 1,234  \x1b[36mtflops: 12.34  \x1b[35mmfu: 1.25%\x1b[39m",
     {"step": 10, "loss": 8.1234, "memory": 35.12, "tps": 1234.0, "tflops": 12.34, "mfu": 1.25}),
    # torch's own noise and other lines that are not a step
    ("torch/distributed/elastic/multiprocessing/api.py warning on every run",
     "[W1128 12:00:00.000000000 socket.cpp:755] [c10d] The hostname of the client socket cannot be retrieved. err=-3", None),
    ("a Python warning naming a loss", "UserWarning: The loss function is deprecated", None),
    ("a traceback line", "RuntimeError: loss is nan at step 3", None),
]
