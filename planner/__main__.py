from planner.cli.main import main

main()
