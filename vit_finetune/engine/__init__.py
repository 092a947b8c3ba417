"""The trainer, in parts: the step loop (loop), what a checkpoint holds (state), the phases of a run (phases),
what happens around steps and epochs (callbacks), the processes of a DDP run (distributed), cached features
(features), the run itself (trainer) and `finetune`, its entry point (api)."""
