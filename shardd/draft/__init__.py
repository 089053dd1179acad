"""DFlash block drafter (z-lab/dflash `DFlashDraftModel`): config, weights, model, synthetic drafters."""
