"""Trainers (SFT, reward model, DPO; RL later), their steps, the host loop and the CLI.

``python -m jaxrlhf.train --config configs/tiny_sft.yaml`` runs ``loop.run``. Import the
pieces you need: ``jaxrlhf.train.loop`` (``run``, ``build_trainer``), ``.steps`` (pure
steps, ``Objective``), ``.sft`` / ``.reward_model`` / ``.dpo`` (losses and configs),
``.optim``, ``.state``.
"""
