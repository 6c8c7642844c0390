from fedray.app.cli import command

command()
