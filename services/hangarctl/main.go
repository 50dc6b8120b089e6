// Command hangar is the operator's and developer's CLI: `hangar status`
// asks every service over D-Bus how it is; `hangar dev` runs a whole host
// without systemd or the image, for development and tests.
package main

import (
	"fmt"
	"os"
)

const usage = `usage: hangar <command> [flags]

commands:
  status        show every service's state and the host's readiness (over D-Bus)
  credentials   print the host's admin credentials as environment variables
  dev           run a host without systemd: private D-Bus, every service, the API
  version       print the version
`

func main() {
	if len(os.Args) < 2 {
		fmt.Fprint(os.Stderr, usage)
		os.Exit(2)
	}
	var err error
	switch os.Args[1] {
	case "status":
		err = cmdStatus(os.Args[2:])
	case "credentials":
		err = cmdCredentials(os.Args[2:])
	case "dev":
		err = cmdDev(os.Args[2:])
	case "version":
		err = cmdVersion()
	case "-h", "--help", "help":
		fmt.Print(usage)
		return
	default:
		fmt.Fprintf(os.Stderr, "hangar: unknown command %q\n\n%s", os.Args[1], usage)
		os.Exit(2)
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "hangar %s: %v\n", os.Args[1], err)
		os.Exit(1)
	}
}
