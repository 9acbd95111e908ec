"""Optimizers beyond torch.optim, each selectable as `optimizer=<name>` (conf/optimizer/<name>.yaml).

- lion: Lion (Chen et al. 2023), `lion.Lion`.
- muon: Muon for hidden matrices with AdamW for the rest (Keller Jordan 2024), `muon.muon_with_adamw`.
- schedule_free_adamw: schedule-free AdamW (Defazio et al. 2024) from the `schedulefree` package,
  `schedule_free.AdamWScheduleFree`; the trainer switches it between train and eval mode.
"""
