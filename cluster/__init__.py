"""Ray composition of Cleave: the `cleave` command line, the Serve application, autoscaling."""
