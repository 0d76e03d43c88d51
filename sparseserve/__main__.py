from sparseserve.entrypoints.cli import main

main()
