"""The rollout every causal pipeline runs: call options, the session, conditioners, chunk sources and policies.

:mod:`.core` runs a call (prepare, then a policy over a chunk plan); :mod:`.live` streams, switches prompts and
continues / redoes / forks kept rollouts; :mod:`.session` holds a rollout's state; ``policy*`` decide which forwards
run; :mod:`.conditioning` and :mod:`.sources` / :mod:`.video_latents` give each chunk its inputs.
"""
