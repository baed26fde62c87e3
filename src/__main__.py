from src.cli import main

main()
