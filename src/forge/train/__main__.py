from forge.train.main import main

main()
