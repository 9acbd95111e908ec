from forge.runtime.commands import forge_train

forge_train()
