from distrun.cli import run

run()
