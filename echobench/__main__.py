from echobench.cli import main

main()
