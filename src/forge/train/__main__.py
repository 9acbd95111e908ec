from forge.train.main import cli

cli()
