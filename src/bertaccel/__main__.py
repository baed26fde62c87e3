from bertaccel.cli import main

main()
