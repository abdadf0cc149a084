"""Training: the trainers (supervised and RL), their programs and pure steps, the host loop,
the dry run and the CLI.

``python -m jaxrlhf.train --config configs/tiny_sft.yaml`` runs ``loop.run``. Import the
pieces you need: ``jaxrlhf.train.loop`` (``run``, ``build_trainer``); ``.config`` and
``.rl_config`` (the sections' dataclasses); ``.steps`` (``train_step``, ``Objective``,
``Learner``); ``.sft`` / ``.reward_model`` / ``.dpo`` (the supervised objectives);
``.rl_programs`` / ``.rl_types`` / ``.rl_steps`` (the RL programs, their typed data, the
update and the losses' wiring); ``.supervised`` / ``.rl_trainer`` (the trainers); ``.optim``,
``.state``; ``.cli`` (the command line, ``main(argv)``).
"""
