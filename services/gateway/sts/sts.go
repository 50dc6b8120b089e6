// Package sts answers the STS actions a client needs to learn who it is.
// Temporary credentials (for instance profiles) are issued elsewhere and
// verified by the same key store.
package sts

import (
	"context"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/sts"

	"hangar.dev/hangar/services/gateway/reqctx"
)

// Service implements STS.
type Service struct{}

// GetCallerIdentity returns the verified caller.
func (Service) GetCallerIdentity(ctx context.Context, _ *sts.GetCallerIdentityInput) (*sts.GetCallerIdentityOutput, error) {
	c := reqctx.From(ctx).Caller
	return &sts.GetCallerIdentityOutput{
		Account: aws.String(c.AccountID),
		Arn:     aws.String(c.ARN),
		UserId:  aws.String(c.UserID),
	}, nil
}
