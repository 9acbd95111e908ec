"""Planning a run before it runs: FLOPs per token and device peaks (flops, peak), the memory model and the
`--plan` report (memory, report), and the layout search (search/). It reads the model through its family's spec
(forge.models.spec) and never imports the trainer."""
