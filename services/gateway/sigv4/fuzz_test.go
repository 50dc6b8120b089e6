package sigv4

import (
	"bytes"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"
)

// FuzzVerify throws arbitrary headers, paths and bodies at the verifier: it
// must never panic, and must never accept a request it did not sign.
func FuzzVerify(f *testing.F) {
	f.Add("AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/20150830/us-east-1/service/aws4_request, SignedHeaders=host;x-amz-date, Signature=5fa00fa31553b73ebf1942676e86291e8372ff2a2260956d9b8aae1d763fbf31", "/", "20150830T123600Z", "")
	f.Add("AWS4-HMAC-SHA256 Credential=a/b/c/d/aws4_request, SignedHeaders=host, Signature=00", "/x/../y", "20150830T123600Z", "Action=X")
	f.Add("AWS4-HMAC-SHA256 Credential=", "//", "garbage", "\x00")
	f.Fuzz(func(t *testing.T, authz, path, date, body string) {
		if len(path) == 0 || path[0] != '/' {
			path = "/" + path
		}
		r := httptest.NewRequest(http.MethodPost, "http://example.amazonaws.com/", bytes.NewReader([]byte(body)))
		r.RequestURI = path
		r.Header.Set("Authorization", authz)
		r.Header.Set("X-Amz-Date", date)
		auth, err := ParseAuth(r)
		if err != nil {
			return
		}
		now, _ := time.Parse("20060102T150405Z", "20150830T123600Z")
		err = Verify(r, []byte(body), auth, Key{SecretAccessKey: "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY"}, now)
		if err == nil && body != "" {
			t.Fatalf("accepted a request with a body whose hash it was not given: %q", authz)
		}
	})
}
